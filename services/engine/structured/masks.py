"""Per request, a grammar matcher; per step, the token masks of every constrained row.

The runner calls ``apply_token_masks`` on the step's logits just before the sampler:
constrained and free requests share the batch, and only the constrained rows are touched.
The scheduler calls ``GrammarState.accept`` as it appends each sampled token. A preempted
request keeps its matcher: recompute re-runs the model over tokens the matcher has already
accepted, so its state stays right.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

_NEG_INF = float("-inf")


class GrammarState:
    """One request's position in its grammar."""

    __slots__ = ("eos_token_ids", "matcher")

    def __init__(self, compiled: Any, eos_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        self.eos_token_ids = list(eos_token_ids)
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=self.eos_token_ids)

    def accept(self, token_id: int) -> None:
        """Advances past a sampled token. A token the grammar refuses can only follow a
        finished grammar (EOS under ``ignore_eos``): the matcher then stays where it is."""
        if not self.matcher.is_terminated():
            self.matcher.accept_token(token_id)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.matcher.is_terminated():  # a finished grammar allows only EOS
            bitmask[row] = 0
            for t in self.eos_token_ids:
                bitmask[row, t // 32] |= 1 << (t % 32)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)


class TokenMasker:
    """The step's bitmask buffer (int32 words, bit ``t % 32`` of word ``t // 32`` = token t
    allowed), reused every step."""

    def __init__(self, vocab_size: int, max_rows: int) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(max_rows, vocab_size)

    def apply(self, logits: torch.Tensor, grammars: Sequence[GrammarState | None]) -> None:
        """Sets the logits of tokens a row's grammar forbids to -inf, in place. Columns past
        the tokenizer's vocabulary (padding rows of the LM head) are never allowed."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return
        for j, i in enumerate(rows):
            grammars[i].fill(self.bitmask, j)
        self.mask(logits, rows)

    def mask(self, logits: torch.Tensor, rows: Sequence[int]) -> None:
        """Applies bitmask rows ``0 .. len(rows) - 1`` (filled by the caller) to the logits rows
        ``rows``, in place."""
        bitmask = self.bitmask[: len(rows)]
        vocab = logits.shape[1]
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")
        forbidden = torch.from_numpy(bits[:, :vocab] == 0).to(logits.device, non_blocking=True)
        if len(rows) == logits.shape[0]:
            logits.masked_fill_(forbidden, _NEG_INF)
            return
        index = torch.tensor(rows, device=logits.device)
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(forbidden,
                                                                                 _NEG_INF))
