"""Engine frames of one choice in, text deltas out: incremental detokenization, stop strings,
logprobs and the final accounting.

Tokens are taken one at a time so that when a stop string completes, the tokens (and their
logprobs) after it are neither counted nor reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.protocol.engine_api import (
    FinishedFrame,
    KVTransferFrame,
    TokenLogprobs,
    TokensFrame,
)
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
    # With the first tokens, when prompt logprobs were asked for: one entry per prompt token
    # (the first None), as the echo's logprobs and in vLLM's ``prompt_logprobs`` JSON shape.
    echo_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


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
        self._prompt_ids = prompt_ids
        # As vLLM: a stop token (stop_token_ids, or EOS while it ends the request) is not
        # part of the text unless include_stop_str_in_output.
        stop_ids = set() if params.include_stop_str_in_output else set(params.stop_token_ids)
        if not params.include_stop_str_in_output and not params.ignore_eos:
            stop_ids.update(tokenizer.eos_token_ids)
        self._stop_ids = frozenset(stop_ids)
        self.totals = ChoiceTotals()
        self.finished = False
        self.kv_transfer_params: dict | None = None  # the engine's, from its finished frame

    def on_frame(self, frame: TokensFrame | FinishedFrame | KVTransferFrame) -> ChoiceDelta:
        """Folds one tokens or finished frame in. After a delta with a finish_reason the
        choice is over (``finished``): the caller closes the engine stream."""
        if isinstance(frame, FinishedFrame):
            return self._finish(frame)
        if isinstance(frame, KVTransferFrame):  # a streamed prefill's: for the gateway's legs
            return ChoiceDelta(self.index)
        if frame.cached_tokens is not None:  # lets usage survive a stop-string close
            self.totals.cached_tokens = frame.cached_tokens
        delta = ChoiceDelta(self.index)
        if frame.prompt_logprobs is not None:
            self._add_prompt_logprobs(delta, frame.prompt_logprobs)
        lps = frame.logprobs if self._want_logprobs else None
        for i, tok in enumerate(frame.token_ids):
            self.totals.completion_tokens += 1
            if lps is not None and lps[i] is not None:
                delta.logprobs.append(self._logprob(lps[i]))
            if tok in self._stop_ids:  # the request's last token: the engine stops on it
                continue
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
        self.kv_transfer_params = frame.kv_transfer_params
        return ChoiceDelta(
            self.index,
            text=self._stops.flush(),
            finish_reason=frame.finish_reason,
            stop_reason=frame.stop_reason,
        )

    def _add_prompt_logprobs(
        self, delta: ChoiceDelta, lps: list[TokenLogprobs | None]
    ) -> None:
        delta.echo_logprobs = [
            TokenLogprob(self._token_text(tid), None, []) if lp is None else self._logprob(lp)
            for tid, lp in zip(self._prompt_ids, lps, strict=True)
        ]
        delta.prompt_logprobs = [None if lp is None else self._logprob_map(lp) for lp in lps]

    def _logprob_map(self, lp: TokenLogprobs) -> dict[str, Any]:
        """vLLM's prompt_logprobs entry: token id -> logprob, rank and text, for the top-N and
        the prompt's own token."""
        out = {
            str(t): {"logprob": v, "rank": r, "decoded_token": self._token_text(t)}
            for r, (t, v) in enumerate(lp.top, start=1)
        }
        out[str(lp.token_id)] = {
            "logprob": lp.logprob, "rank": lp.rank, "decoded_token": self._token_text(lp.token_id)
        }
        return out

    def _logprob(self, lp: TokenLogprobs) -> TokenLogprob:
        top = [(self._token_text(t), v) for t, v in lp.top]
        return TokenLogprob(self._token_text(lp.token_id), lp.logprob, top)

    def _token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)
