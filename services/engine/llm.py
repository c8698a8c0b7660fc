"""The offline API: ``LLM().generate(prompts, SamplingParams(...))``, as in vLLM."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Self

from tqdm import tqdm

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.lora.request import LoRARequest
from services.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from services.engine.request import Request
from services.protocol.engine_api import TokenLogprobs
from services.protocol.sampling_params import SamplingParams
from services.text.detokenizer import IncrementalDetokenizer, detokenize_batch
from services.text.stop import StopStringMatcher
from services.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]
Conversation = Sequence[dict[str, Any]]
# One adapter for every prompt, or one per prompt (None: the base model).
LoRAArg = LoRARequest | Sequence[LoRARequest | None] | None


@dataclass(slots=True)
class _TextStream:
    """The text of a sample with stop strings, as it grows: the stop check needs it each step."""

    detok: IncrementalDetokenizer
    stops: StopStringMatcher


@dataclass(slots=True)
class _Child:
    """One of a request's ``n`` samples while it runs."""

    output: CompletionOutput
    params: SamplingParams
    # None without stop strings: then the text is decoded once, when the sample finishes
    # (``_finish``), and the step loop never detokenizes.
    stream: _TextStream | None
    # Output tokens that stand when a stop string ended the sample inside a step's tokens
    # (a verified step gives several); None: all of them.
    num_tokens: int | None = None


@dataclass(slots=True)
class _Parent:
    output: RequestOutput
    children: list[_Child] = field(default_factory=list)
    unfinished: int = 0


class LLM:
    """Loads a model once; ``generate`` runs prompts to completion with continuous batching."""

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))
        self.tokenizer = Tokenizer(self.engine.model_path)
        self._ids = itertools.count()
        self._token_texts: dict[int, str] = {}  # token id -> its text, for logprobs

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    # -- lifetime ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Releases the engine's threads, tensor-parallel workers and process group, so that
        another ``LLM`` can start in this process. Idempotent. Also done when the ``LLM`` is
        garbage collected (``del llm``) and at interpreter exit; ``with LLM(...) as llm:``
        does it on leaving the block."""
        self.engine.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
        lora_request: LoRAArg = None,
    ) -> list[RequestOutput]:
        """``lora_request``: a ``LoRARequest`` for every prompt, or a list with one per prompt
        (``None`` for the base model); the engine needs ``enable_lora=True``."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast_params(sampling_params, len(prompt_list))
        encoded = [self._encode(p) for p in prompt_list]
        return self.run_encoded(encoded, params_list, use_tqdm, cache_salt,
                                _broadcast_lora(lora_request, len(prompt_list)))

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        lora_request: LoRAArg = None,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be "
                             "true")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        encoded = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                continue_final_message=continue_final_message,
            )
            encoded.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        params_list = _broadcast_params(sampling_params, len(encoded))
        return self.run_encoded(encoded, params_list, use_tqdm, None,
                                _broadcast_lora(lora_request, len(encoded)))

    # -- internals --------------------------------------------------------------------------

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def run_encoded(
        self,
        encoded: list[tuple[str | None, list[int]]],
        params_list: list[SamplingParams],
        use_tqdm: bool,
        cache_salt: str | None,
        loras: Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        if self.engine.closed:
            raise RuntimeError("this LLM was shut down: build a new one to generate again")
        parents: list[_Parent] = []
        by_child_id: dict[str, tuple[_Parent, _Child]] = {}
        loras = loras or [None] * len(encoded)
        try:
            for (text, ids), params, lora in zip(encoded, params_list, loras, strict=True):
                parent = self._add(text, ids, params, cache_salt, by_child_id, lora)
                parents.append(parent)
            self._drive(by_child_id, len(parents), use_tqdm)
        except BaseException:
            for child_id in list(by_child_id):
                self.engine.abort_request(child_id)
            raise
        return [p.output for p in parents]

    def _add(self, text, ids, params, cache_salt, by_child_id, lora=None) -> _Parent:
        rid = str(next(self._ids))
        parent = _Parent(RequestOutput(request_id=rid, prompt=text, prompt_token_ids=ids))
        for i in range(params.n):
            # Each of the n samples is its own engine request; the prefix cache shares the
            # prompt's KV between them. Seeded samples get distinct, reproducible seeds.
            child_params = params if params.seed is None else replace(params, seed=params.seed + i)
            child_id = f"{rid}-{i}"
            self.engine.add_request(child_id, ids, child_params, cache_salt, lora)
            child = _Child(
                output=CompletionOutput(index=i, text="", token_ids=[]),
                params=params,
                stream=self._text_stream(ids, params),
            )
            if params.logprobs is not None:
                child.output.logprobs = []
                child.output.cumulative_logprob = 0.0
            parent.children.append(child)
            parent.output.outputs.append(child.output)
            parent.unfinished += 1
            by_child_id[child_id] = (parent, child)
        return parent

    def _text_stream(self, ids: list[int], params: SamplingParams) -> _TextStream | None:
        if not any(params.stop):
            return None
        return _TextStream(
            IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens),
            StopStringMatcher(params.stop, params.include_stop_str_in_output),
        )

    def _drive(self, by_child_id, num_requests: int, use_tqdm: bool) -> None:
        bar = tqdm(total=num_requests, desc="Generating", disable=not use_tqdm, unit="req")
        # Samples with stop strings follow their text token by token; the others need a
        # token only for its logprobs, or when it ends them.
        streamed = {cid for cid, (_, child) in by_child_id.items() if child.stream is not None}
        # Without streams or logprobs only a sample that finished needs anything, so a step
        # that finished none is not walked (``update`` counts the requests it finishes).
        every_step = bool(streamed) or any(
            child.output.logprobs is not None for _, child in by_child_id.values())
        scheduler = self.engine.scheduler
        with bar:
            while self.engine.has_unfinished_requests():
                num_finished = scheduler.num_finished
                stepped = self.engine.step_requests()
                if not every_step and scheduler.num_finished == num_finished:
                    continue
                finished = []
                for req, lps in stepped:
                    if lps[0] is None and not req.status.is_finished and (
                            not streamed or req.request_id not in streamed):
                        continue  # nothing to fold in until it finishes
                    parent, child = by_child_id[req.request_id]
                    if self._apply(child, req, lps):
                        finished.append((parent, child, req))
                self._finish(finished, bar)

    def _apply(self, child: _Child, req: Request, lps: list[TokenLogprobs | None]) -> bool:
        """Folds the request's new tokens (its last ``len(lps)`` output tokens) into what
        needs them at once: logprobs, and the text of a sample with stop strings. True when
        the sample finished; its tokens are copied then (``_finish``)."""
        out = child.output
        kept, stop = len(lps), None
        if child.stream is not None:
            kept, stop = self._feed_text(child.stream, out, req, len(lps))
        if out.logprobs is not None:
            for lp in lps[:kept]:
                if lp is not None:
                    out.logprobs.append(self._logprob_dict(lp))
                    out.cumulative_logprob += lp.logprob
        if stop is not None:
            out.finish_reason, out.stop_reason = "stop", stop
            child.num_tokens = req.num_output_tokens - (len(lps) - kept)
            return True
        if req.status.is_finished:
            out.finish_reason, out.stop_reason = req.finish_reason, req.stop_reason
            return True
        return False

    def _feed_text(
        self, stream: _TextStream, out: CompletionOutput, req: Request, n: int
    ) -> tuple[int, str | None]:
        """Extends the text of a sample with stop strings by its ``n`` new tokens, one at a
        time; returns how many of them stand (those up to a stop string's end) and the stop
        string it hit."""
        finished = req.status.is_finished
        new = req.token_ids[-n:]
        if _ended_by_token(req.finish_reason, req.params):
            new = new[:-1]  # the stop token is not part of the text
        for i, tok in enumerate(new):
            emitted, stop = stream.stops.feed(stream.detok.push([tok]))
            out.text += emitted
            if stop is not None:
                if not finished:
                    self.engine.abort_request(req.request_id)
                return i + 1, stop
        if finished:
            out.text += stream.stops.flush()
        return n, None

    def _finish(self, finished: list[tuple[_Parent, _Child, Request]], bar: tqdm) -> None:
        """Completes this step's finished samples, and the requests they were the last of."""
        now = time.monotonic()
        for parent, child, req in finished:
            start, n = req.num_prompt_tokens, child.num_tokens  # n: None for all of them
            child.output.token_ids = req.token_ids[start : None if n is None else start + n]
            _record_metrics(parent.output, req, now)
            if req.params.prompt_logprobs is not None and parent.output.prompt_logprobs is None:
                parent.output.prompt_logprobs = [
                    None if lp is None else self._logprob_dict(lp) for lp in req.prompt_logprobs
                ]
        self._decode_texts([(p, c) for p, c, _ in finished if c.stream is None])
        for parent, _, _ in finished:
            parent.unfinished -= 1
            if parent.unfinished == 0:
                parent.output.finished = True
                bar.update(1)

    def _decode_texts(self, samples: list[tuple[_Parent, _Child]]) -> None:
        """Sets the text of finished samples without a stream: one batched decode for each
        skip_special_tokens setting among them."""
        for skip in (True, False):
            batch = [(p, c) for p, c in samples if c.params.skip_special_tokens is skip]
            if not batch:
                continue
            prompts = [p.output.prompt_token_ids for p, _ in batch]
            outputs = [
                c.output.token_ids[:-1]
                if _ended_by_token(c.output.finish_reason, c.params) else c.output.token_ids
                for _, c in batch
            ]
            texts = detokenize_batch(self.tokenizer, prompts, outputs, skip)
            for (_, child), text in zip(batch, texts, strict=True):
                child.output.text = text

    def _logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        d = {
            tid: Logprob(v, rank + 1, self._token_text(tid)) for rank, (tid, v) in enumerate(lp.top)
        }
        d[lp.token_id] = Logprob(lp.logprob, lp.rank, self._token_text(lp.token_id))
        return d

    def _token_text(self, token_id: int) -> str:
        # Memoised: logprobs ask for the same tokens' texts over and over, every step.
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode(
                [token_id], skip_special_tokens=False
            )
        return text


def _ended_by_token(finish_reason: str | None, params: SamplingParams) -> bool:
    """A request that a stop token (EOS or stop_token_ids) ended: as vLLM, that token is not
    part of the text unless include_stop_str_in_output. (Stop strings end it in the text.)"""
    return finish_reason == "stop" and not params.include_stop_str_in_output


def _record_metrics(output: RequestOutput, req: Request, now: float) -> None:
    """The request's figures, folded in as each of its samples finishes."""
    output.num_cached_tokens = max(req.num_cached_tokens, 0)
    m = output.metrics
    if m is None:
        m = output.metrics = RequestMetrics(arrival_time=req.arrival_time)
    first = req.first_token_time
    if first is not None and (m.first_token_time is None or first < m.first_token_time):
        m.first_token_time = first
    m.finished_time = now


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not prompts:
        raise ValueError("prompts must not be empty")
    if all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return list(prompts)


def _broadcast_lora(lora: LoRAArg, n: int) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    lora = list(lora)
    if len(lora) != n:
        raise ValueError(f"got {len(lora)} LoRA requests for {n} prompts")
    if not all(r is None or isinstance(r, LoRARequest) for r in lora):
        raise ValueError("lora_request must hold LoRARequest or None entries")
    return lora


def _broadcast_params(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params
