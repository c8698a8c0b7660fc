"""How fast this engine computes prompt tokens: what a pull of KV must beat to be worth waiting
for (``PagodaPDConnector`` abandons a pull that takes longer than recomputing its tokens).

The engine thread observes its steps; pull threads read ``seconds_for``. One float is written
and read whole, so no lock is needed."""

from __future__ import annotations


class ComputeRate:
    def __init__(self, min_tokens: int = 32, alpha: float = 0.3) -> None:
        self.min_tokens, self.alpha = min_tokens, alpha
        self.tokens_per_s: float | None = None  # None: not measured yet

    def observe(self, tokens: int, seconds: float) -> None:
        """A step computed ``tokens`` in ``seconds`` (decode-only steps say little about a
        prompt's cost: steps under ``min_tokens`` are skipped)."""
        if tokens < self.min_tokens or seconds <= 0:
            return
        rate = tokens / seconds
        old = self.tokens_per_s
        self.tokens_per_s = rate if old is None else (1 - self.alpha) * old + self.alpha * rate

    def seconds_for(self, tokens: int) -> float | None:
        rate = self.tokens_per_s
        return None if rate is None else tokens / rate
