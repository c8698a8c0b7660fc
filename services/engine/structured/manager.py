"""Structured outputs as a step feature: the one owner of the running rows' grammar states and
of the step's bitmask.

Rows join with their request's ``GrammarState`` and leave with it (``step_features``); a step
gathers the sampled rows' states when any is constrained, and ``apply`` is the one entry point
that fills the bitmask (per sampled row, or per verified position through a verifier's
``fill``) and masks the logits: the runner and the verifier only call it. The scheduler
advances each state by the tokens a step emits (``GrammarState.accept``), so the next step's
masks follow.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from services.engine.features.protocol import (
    ModelRunner,
    PreparedStep,
    Request,
    StepFeature,
    StepRows,
)
from services.engine.structured.masks import GrammarState, TokenMasker


class GrammarManager(StepFeature):
    """Every row's grammar (None: unconstrained) and the bitmask, made on first use."""

    name = "structured"

    def __init__(self, max_rows: int, vocab_size: int, mask_rows: int) -> None:
        """``mask_rows``: the most logits rows one step masks (every verified position)."""
        self.vocab_size = vocab_size
        self.mask_rows = mask_rows
        self.grammar: list[GrammarState | None] = [None] * max_rows
        self.constrained = 0  # live rows with a grammar
        self.masker: TokenMasker | None = None

    # -- rows -------------------------------------------------------------------------------

    def join(self, req: Request, row: int) -> None:
        self.grammar[row] = req.grammar
        self.constrained += req.grammar is not None

    def leave(self, req: Request, row: int) -> None:
        self.constrained -= req.grammar is not None
        self.grammar[row] = None

    def move(self, src: int, dst: int) -> None:
        self.grammar[dst] = self.grammar[src]
        self.grammar[src] = None

    def needs_host_tokens(self) -> bool:
        """A grammar advances with each token before the next step's mask."""
        return self.constrained > 0

    # -- one step ---------------------------------------------------------------------------

    def grammars(self, rows: Sequence[int]) -> list[GrammarState | None] | None:
        """The rows' grammar states, in order; None when none of them is constrained."""
        if not self.constrained:
            return None
        out = [self.grammar[r] for r in rows]
        return out if any(g is not None for g in out) else None

    def prepare_rows(self, rows: StepRows) -> list[GrammarState | None] | None:
        return self.grammars(rows.sampled_rows.tolist())

    def whole_logits(self, state: Any) -> bool:
        return state is not None

    def after_logits(self, logits: torch.Tensor, state: Any, step: PreparedStep) -> None:
        """One logits row per sampled row. A step that scores more rows per sequence
        (``StepBatch.extra_logits``: verified positions) is masked by the feature that asked
        for them, which calls ``apply`` with its own fill."""
        if state is not None and step.batch.extra_logits is None:
            self.apply(logits, state)

    def apply(
        self,
        logits: torch.Tensor,
        grammars: Sequence[GrammarState | None],
        fill: Callable[[torch.Tensor], list[int]] | None = None,
    ) -> None:
        """The one way a step's logits are masked: sets the logits of tokens a grammar forbids
        to -inf, in place. Without ``fill`` one logits row per grammar; ``fill`` (a verifier:
        every verified position) fills bitmask rows ``0, 1, ...`` itself and returns
        the logits rows they belong to."""
        masker = self.token_masker()
        if fill is None:
            masker.apply(logits, grammars)
            return
        rows = fill(masker.bitmask)
        if rows:
            masker.mask(logits, rows)

    def token_masker(self) -> TokenMasker:
        if self.masker is None:  # only engines that meet a constrained request pay for it
            self.masker = TokenMasker(self.vocab_size, self.mask_rows)
        return self.masker

    # -- before serving ---------------------------------------------------------------------

    def warm_up_logits(
        self, runner: ModelRunner, logits: torch.Tensor, compiling: bool
    ) -> list[str]:
        """Where kernels compile (a GPU), the bitmask applied to every row once (every token
        allowed); on the CPU the masks are element-wise torch ops with nothing to build, and
        xgrammar's import is left to the first constrained request."""
        if not compiling:
            return []
        masker = self.token_masker()
        masker.bitmask[: len(logits)] = -1  # every token allowed: the logits stay as they are
        masker.mask(logits, list(range(len(logits))))
        return ["grammar masks"]
