"""vLLM's ``prompt_logprobs``: each prompt token's logprob given the tokens before it, with the
top-N alternatives (the first prompt token has none: ``None``).

Only requests that ask pay for it. The hidden state at position ``j`` predicts token ``j + 1``,
so after a step's forward pass the rows of such a request's new prompt positions go through
the LM head (in slices, to bound the memory of ``rows x vocab`` logits) and are scored against
the prompt tokens that follow them. A chunked prefill collects them chunk by chunk. Those
requests do not read the prefix cache until their prompt is scored (a cached prefix has no
hidden states), as vLLM; after a preemption the positions already scored are not scored again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from services.engine.step_features import StepFeature, StepRows
from services.protocol.engine_api import TokenLogprobs

if TYPE_CHECKING:  # the scheduler imports this module
    from services.engine.model_runner import StepResult
    from services.engine.request import Request
    from services.engine.scheduler import ScheduledRequest

_ROWS_PER_SLICE = 256  # logits rows at once: 256 x 152k vocabulary x 4 bytes = 155 MB


@dataclass(slots=True)
class _Span:
    """One request's rows of this step: hidden rows [row, row + count) score prompt tokens
    [first + 1, first + 1 + count), ``targets`` (a copy, taken when the step is prepared)."""

    index: int  # the request's place in the step's schedule
    row: int
    first: int
    count: int
    top_n: int
    targets: list[int]


def reads_prefix_cache(request: Request) -> bool:
    """False while a prompt_logprobs request still has prompt positions to score."""
    pending = request.params.prompt_logprobs is not None
    return not pending or len(request.prompt_logprobs) >= request.num_prompt_tokens


class PromptScorer:
    """Scores one step's new prompt positions of the requests that asked; built when the step
    is prepared (engine thread), it keeps what it reads of the requests. The runner computes
    the logits of each hidden-row slice of ``flat_slices()`` in order and hands them to
    ``add``, one slice at a time, so at most one slice of ``rows x vocab`` logits is alive."""

    def __init__(
        self, scheduled: Sequence[ScheduledRequest], query_lens: Sequence[int]
    ) -> None:
        self._spans = _spans(scheduled, query_lens)
        # (span index, first row within the span, row count), in the order logits arrive
        self._pieces = [
            (i, lo, min(_ROWS_PER_SLICE, span.count - lo))
            for i, span in enumerate(self._spans)
            for lo in range(0, span.count, _ROWS_PER_SLICE)
        ]
        self._entries: list[list[TokenLogprobs]] = [[] for _ in self._spans]
        self._next = 0

    def flat_slices(self) -> list[int]:
        """(first hidden row, count) of each slice, flattened."""
        return [v for i, lo, n in self._pieces for v in (self._spans[i].row + lo, n)]

    def add(self, logits: torch.Tensor) -> None:
        i, lo, n = self._pieces[self._next]
        self._next += 1
        span = self._spans[i]
        self._entries[i].extend(_score(logits, span.targets[lo : lo + n], span.top_n))

    def results(self) -> list[tuple[int, list[TokenLogprobs]]]:
        """(the request's place in the step's schedule, entries in prompt order, to append to
        its ``prompt_logprobs``)."""
        assert self._next == len(self._pieces), "a slice's logits did not arrive"
        return [(span.index, e) for span, e in zip(self._spans, self._entries, strict=True)]


class PromptLogprobs(StepFeature):
    """Prompt logprobs as a step feature: a step with such rows gets a ``PromptScorer``, its
    slices cross to the other ranks in ``StepBatch.scored`` (the LM head is a collective), and
    the scored entries go into the step's result."""

    name = "prompt_logprobs"

    def __init__(self) -> None:
        self.rows = 0  # live rows that asked

    def join(self, req: Request, row: int) -> None:
        self.rows += req.params.prompt_logprobs is not None

    def leave(self, req: Request, row: int) -> None:
        self.rows -= req.params.prompt_logprobs is not None

    def needs_host_tokens(self) -> bool:
        """They are collected across chunks, in order."""
        return self.rows > 0

    def prepare_rows(self, rows: StepRows) -> PromptScorer | None:
        if not self.rows:
            return None
        scorer = PromptScorer(rows.sched.scheduled, rows.query_lens)
        rows.batch.scored = scorer.flat_slices()
        return scorer

    def slice_scorer(self, state: Any) -> Callable[[torch.Tensor], None] | None:
        return None if state is None else state.add

    def finish(self, state: Any, result: StepResult) -> None:
        if state is not None:
            result.prompt_logprobs = state.results()


def _spans(scheduled: Sequence[ScheduledRequest], query_lens: Sequence[int]) -> list[_Span]:
    spans, row = [], 0
    for index, (s, q) in enumerate(zip(scheduled, query_lens, strict=True)):
        req = s.request
        if req.params.prompt_logprobs is not None:
            # Positions j score prompt token j + 1: j <= prompt_len - 2, and not scored yet.
            start = max(s.start, len(req.prompt_logprobs) - 1)
            end = min(s.start + q, req.num_prompt_tokens - 1)
            if end > start:
                targets = req.prompt_token_ids[start + 1 : end + 1]
                spans.append(_Span(index, row + start - s.start, start, end - start,
                                   req.params.prompt_logprobs, targets))
        row += q
    return spans


def _score(logits: torch.Tensor, targets: Sequence[int], top_n: int) -> list[TokenLogprobs]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target = torch.tensor(targets, dtype=torch.long, device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, target)
    ranks = (logprobs >= chosen).sum(-1)
    top_lp, top_ids = logprobs.topk(min(top_n, logprobs.shape[1]), dim=-1)
    return [
        TokenLogprobs(t, lp, rank, list(zip(ids, lps, strict=True)))
        for t, lp, rank, ids, lps in zip(
            targets,
            chosen.squeeze(1).tolist(),
            ranks.tolist(),
            top_ids.tolist(),
            top_lp.tolist(),
            strict=True,
        )
    ]
