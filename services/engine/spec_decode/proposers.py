"""Proposing drafts, engine thread, before each schedule (``Speculator.propose``, called by
the verifier's ``before_schedule``).

Each running request that decodes with all its tokens known gets ``num_speculative_tokens``
drafts (fewer near max_tokens or the context; none while more than ``disable_by_batch_size``
requests run). Prompt lookup (``ngram``) finds them at once and hands them to the verifier for
the request's row; a draft model proposes them inside the step, so only their count is set.
The scheduler then schedules ``1 + k`` tokens. After the step, ``record`` counts the verdicts
(``metrics``) and tells the verifier.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from services.engine.config import SpecMethod, SpeculativeConfig
from services.engine.request import Request
from services.engine.scheduler import SchedulerOutput
from services.engine.spec_decode.metrics import SpecDecodeStats
from services.engine.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:
    from services.engine.spec_decode.verifier import SpecOutput, Verifier


class Speculator:
    """The engine thread's side of speculative decoding (see the module docstring)."""

    def __init__(self, spec: SpeculativeConfig, max_model_len: int, verifier: Verifier) -> None:
        self.spec = spec
        self.max_model_len = max_model_len
        self.verifier = verifier
        self.ngram = (NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
                      if spec.method is SpecMethod.NGRAM else None)
        self.stats = SpecDecodeStats(spec.num_speculative_tokens)

    def propose(self, running: Sequence[Request]) -> None:
        """Sets each running request's ``num_lookahead_tokens`` for the next schedule."""
        k = self.spec.num_speculative_tokens
        on = self.spec.drafts_at(len(running))
        max_len = self.max_model_len
        for req in running:
            n = 0
            if (on and not req.num_placeholders and not req.num_scheduled_tokens
                    and req.num_computed_tokens == len(req.token_ids) - 1):
                room = min(k, req.max_tokens - req.num_output_tokens,
                           max_len - len(req.token_ids))
                if room > 0:
                    n = self._drafts(req, room)
            req.num_lookahead_tokens = n
        if self.ngram is not None:
            self.ngram.end_step()

    def _drafts(self, req: Request, room: int) -> int:
        row = req.batch_row
        assert row >= 0, req.request_id  # a decoding request has had a step, so a row
        if self.ngram is None:  # the draft model fills them in the step
            self.verifier.hold(row, [0] * room)
            return room
        found = self.ngram.propose(req.request_id, req.token_ids, room)
        self.verifier.hold(row, found)
        return len(found)

    def record(self, sched: SchedulerOutput, out: SpecOutput) -> None:
        """After the step was applied (rows of finished requests already given back)."""
        self.stats.observe(out.num_drafts, out.num_accepted)
        self.verifier.record(sched, out)
