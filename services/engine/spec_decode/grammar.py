"""Structured outputs under speculation: every verified position is masked by the grammar as
it stands after the drafts before that position, and the matcher ends where it began.

For a constrained request with drafts ``d_1 .. d_k`` the masks of positions ``0 .. k`` are
filled while its matcher accepts ``d_1, d_2, ...`` one by one; the matcher is then rolled back
by as many tokens (xgrammar keeps the history for it), so a rejected draft never stays in the
grammar's state. The scheduler advances it by the tokens the step actually emits, as for any
step. A draft the grammar refuses leaves the matcher where it is: the position that verifies it
forbids it, so it is rejected there, and the positions after it (never reached) reuse that mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.engine.structured.masks import GrammarState


def fill_position_masks(bitmask: torch.Tensor, grammars: Sequence[GrammarState | None],
                        num_drafts: Sequence[int], drafts: Sequence[Sequence[int]]) -> list[int]:
    """Fills bitmask rows ``0, 1, ...`` for every verified position of the constrained rows
    (row i has ``1 + num_drafts[i]`` positions, in logits order); returns the logits rows they
    belong to."""
    rows: list[int] = []
    position = 0
    for g, k, ds in zip(grammars, num_drafts, drafts, strict=True):
        if g is not None:
            advanced = _fill(bitmask, g, len(rows), position, k, ds, rows)
            if advanced:
                g.matcher.rollback(advanced)
        position += 1 + k
    return rows


def _fill(bitmask: torch.Tensor, g: GrammarState, first: int, position: int, k: int,
          ds: Sequence[int], rows: list[int]) -> int:
    """One request's masks; returns how many drafts its matcher accepted (to roll back)."""
    matcher = g.matcher
    advanced = 0
    for j in range(k + 1):
        g.fill(bitmask, first + j)
        rows.append(position + j)
        if j < k and advanced == j and not matcher.is_terminated() and \
                matcher.accept_token(int(ds[j])):
            advanced += 1
    return advanced
