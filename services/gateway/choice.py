"""Engine frames of one choice in, text deltas out: incremental detokenization, stop strings,
logprobs and the final accounting.

Tokens are taken one at a time so that when a stop string completes, the tokens (and their
logprobs) after it are neither counted nor reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.engine.sampling_params import SamplingParams
from services.protocol.openai import TokenLogprob
from services.text.detokenizer import IncrementalDetokenizer
from services.text.stop import StopStringMatcher
from services.text.tokenizer import Tokenizer


@dataclass(slots=True)
class ChoiceDelta:
    """What one frame added to one choice."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # set on the choice's last delta
    stop_reason: int | str | None = None


@dataclass(slots=True)
class ChoiceTotals:
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the engine served from its prefix cache


class ChoiceDecoder:
    def __init__(
        self, index: int, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams
    ) -> None:
        self.index = index
        self._tok = tokenizer
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self._stops = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self._want_logprobs = params.logprobs is not None
        self.totals = ChoiceTotals()
        self.finished = False

    def on_frame(self, frame: dict[str, Any]) -> ChoiceDelta:
        """Folds one ``tokens`` or ``finished`` frame in. After a delta with a finish_reason
        the choice is over (``finished``): the caller closes the engine stream."""
        if frame["type"] == "finished":
            return self._finish(frame)
        cached = frame.get("cached_tokens")  # optional: lets usage survive a stop-string close
        if isinstance(cached, int) and not isinstance(cached, bool):
            self.totals.cached_tokens = cached
        delta = ChoiceDelta(self.index)
        lps = frame.get("logprobs")
        for i, tok in enumerate(frame["token_ids"]):
            self.totals.completion_tokens += 1
            if self._want_logprobs and isinstance(lps, list) and i < len(lps):
                item = self._logprob(tok, lps[i])
                if item is not None:
                    delta.logprobs.append(item)
            text, stop = self._stops.feed(self._detok.push([tok]))
            delta.text += text
            if stop is not None:
                self.finished = True
                delta.finish_reason, delta.stop_reason = "stop", stop
                break
        return delta

    def _finish(self, frame: dict[str, Any]) -> ChoiceDelta:
        self.finished = True
        usage = frame.get("usage") if isinstance(frame.get("usage"), dict) else {}
        cached = usage.get("cached_tokens")
        if isinstance(cached, int) and not isinstance(cached, bool):
            self.totals.cached_tokens = cached
        reason = frame.get("finish_reason")
        stop_reason = frame.get("stop_reason")
        return ChoiceDelta(
            self.index,
            text=self._stops.flush(),
            finish_reason=reason if isinstance(reason, str) else "stop",
            stop_reason=stop_reason if isinstance(stop_reason, (int, str)) else None,
        )

    def _logprob(self, token_id: int, raw: Any) -> TokenLogprob | None:
        """The engine's ``{"token_id", "logprob", "rank", "top": [[id, logprob], ...]}``."""
        if not isinstance(raw, dict) or not isinstance(raw.get("logprob"), (int, float)):
            return None
        top = []
        for pair in raw.get("top") or ():
            if isinstance(pair, (list, tuple)) and len(pair) == 2:
                top.append((self._token_text(pair[0]), float(pair[1])))
        return TokenLogprob(self._token_text(token_id), float(raw["logprob"]), top)

    def _token_text(self, token_id: Any) -> str:
        if not isinstance(token_id, int) or token_id < 0:
            return ""
        return self._tok.decode([token_id], skip_special_tokens=False)
