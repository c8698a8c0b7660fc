"""Engine frames of one choice in, text deltas out: incremental detokenization, stop strings,
logprobs and the final accounting.

Tokens are taken one at a time so that when a stop string completes, the tokens (and their
logprobs) after it are neither counted nor reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.protocol.engine_api import FinishedFrame, TokenLogprobs, TokensFrame
from services.protocol.openai import TokenLogprob
from services.protocol.sampling_params import SamplingParams
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

    def on_frame(self, frame: TokensFrame | FinishedFrame) -> ChoiceDelta:
        """Folds one tokens or finished frame in. After a delta with a finish_reason the
        choice is over (``finished``): the caller closes the engine stream."""
        if isinstance(frame, FinishedFrame):
            return self._finish(frame)
        if frame.cached_tokens is not None:  # lets usage survive a stop-string close
            self.totals.cached_tokens = frame.cached_tokens
        delta = ChoiceDelta(self.index)
        lps = frame.logprobs if self._want_logprobs else None
        for i, tok in enumerate(frame.token_ids):
            self.totals.completion_tokens += 1
            if lps is not None and lps[i] is not None:
                delta.logprobs.append(self._logprob(lps[i]))
            text, stop = self._stops.feed(self._detok.push([tok]))
            delta.text += text
            if stop is not None:
                self.finished = True
                delta.finish_reason, delta.stop_reason = "stop", stop
                break
        return delta

    def _finish(self, frame: FinishedFrame) -> ChoiceDelta:
        self.finished = True
        self.totals.cached_tokens = frame.cached_tokens
        return ChoiceDelta(
            self.index,
            text=self._stops.flush(),
            finish_reason=frame.finish_reason,
            stop_reason=frame.stop_reason,
        )

    def _logprob(self, lp: TokenLogprobs) -> TokenLogprob:
        top = [(self._token_text(t), v) for t, v in lp.top]
        return TokenLogprob(self._token_text(lp.token_id), lp.logprob, top)

    def _token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)
