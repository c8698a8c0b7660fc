"""Stop strings over streamed text: emit what is safe, hold back what might start a stop."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Feeds text deltas; ``feed`` returns (text safe to emit now, the stop string hit or None).

    Up to ``max(len(stop)) - 1`` trailing characters are held back while they could still be
    the beginning of a stop string, so a client never sees part of a stop sequence.
    """

    def __init__(self, stop: Sequence[str], include_in_output: bool = False) -> None:
        self._stops = [s for s in stop if s]
        self._include = include_in_output
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""
        self.stopped: str | None = None

    def feed(self, delta: str) -> tuple[str, str | None]:
        if self.stopped is not None:
            return "", self.stopped
        if not self._stops:
            return delta, None
        self._pending += delta
        hit = self._earliest_match(self._pending)
        if hit is not None:
            idx, stop = hit
            end = idx + len(stop) if self._include else idx
            out, self._pending, self.stopped = self._pending[:end], "", stop
            return out, stop
        cut = len(self._pending) - self._hold
        if cut <= 0:
            return "", None
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, None

    def flush(self) -> str:
        """The held-back text, once generation has ended without a stop string."""
        out, self._pending = self._pending, ""
        return out

    def _earliest_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self._stops:
            i = text.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best
