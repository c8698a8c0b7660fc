"""Prompt lookup (vLLM's ``ngram`` method): the drafts are what followed the sequence's own last
n tokens the first time they appeared before.

For a sequence ``t_0 .. t_{L-1}`` the proposer looks for the longest suffix ``t_{L-n} ..
t_{L-1}`` with ``prompt_lookup_min <= n <= prompt_lookup_max`` that also ends at an earlier
position ``e < L - 1`` (``t_{e-n+1} .. t_e``), takes the earliest such ``e`` among the longest
matches (vLLM's choice), and proposes ``t_{e+1} ..`` up to ``k`` tokens (fewer near the end).
A summary, a translation with names kept, code that repeats its identifiers: whatever copies
from its input gets several tokens a step for the price of one forward pass.

The search is vectorised: for every candidate end ``e`` the length of the match ending there
grows by one comparison pass per suffix token (``prompt_lookup_max`` passes over the
sequence). Each running request's tokens live in a numpy buffer that only appends what is new
since the last step, so a step costs O(sequence) numpy work per drafting request, and no
Python loop over tokens.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n, (min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n
        # request id -> (its tokens so far, how many of them are written)
        self._seqs: dict[str, tuple[np.ndarray, int]] = {}
        self._touched: dict[str, tuple[np.ndarray, int]] = {}

    def propose(self, key: str, token_ids: list[int], k: int) -> np.ndarray:
        """Up to ``k`` drafts for the sequence ``token_ids`` (int64; empty: none found)."""
        seq = self._sequence(key, token_ids)
        return find_drafts(seq, self.min_n, self.max_n, k)

    def end_step(self) -> None:
        """Forgets the sequences not proposed for since the last call (requests that left, or
        prefill)."""
        self._seqs, self._touched = self._touched, {}

    def _sequence(self, key: str, token_ids: list[int]) -> np.ndarray:
        buf, written = self._seqs.get(key) or self._touched.get(key) or (None, 0)
        n = len(token_ids)
        if buf is None or n > len(buf) or written > n:
            grown = np.empty(max(2 * n, 64), dtype=np.int64)
            if buf is not None and written <= n:
                grown[:written] = buf[:written]
            else:
                written = 0
            buf = grown
        if n > written:
            buf[written:n] = token_ids[written:n]
        self._touched[key] = (buf, n)
        return buf[:n]


def find_drafts(seq: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """The prompt-lookup drafts of ``seq`` (see the module docstring)."""
    length = len(seq)
    if length < min_n + 1 or k <= 0:
        return seq[:0]
    # match[e]: how many tokens ending at e equal the sequence's last ones (capped at max_n);
    # candidates e = 0 .. L-2, so at least one token follows each.
    ends = length - 1
    match = np.zeros(ends, dtype=np.int64)
    alive = np.ones(ends, dtype=bool)
    for j in range(min(max_n, ends)):
        # candidate e compares t_{e-j} with t_{L-1-j}; e < j has nothing there
        same = np.zeros(ends, dtype=bool)
        same[j:] = seq[: ends - j] == seq[length - 1 - j]
        alive &= same
        if not alive.any():
            break
        match += alive
    best = int(match.max(initial=0))
    if best < min_n:
        return seq[:0]
    end = int(np.argmax(match == best))  # the earliest of the longest
    return seq[end + 1 : end + 1 + k].copy()
