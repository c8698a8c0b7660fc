"""The offline API: ``LLM().generate(prompts, SamplingParams(...))``, as in vLLM."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tqdm import tqdm

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine, RequestUpdate
from services.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from services.protocol.engine_api import TokenLogprobs
from services.protocol.sampling_params import SamplingParams
from services.text.detokenizer import IncrementalDetokenizer
from services.text.stop import StopStringMatcher
from services.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]
Conversation = Sequence[dict[str, Any]]


@dataclass(slots=True)
class _Child:
    """One of a request's ``n`` samples while it runs."""

    output: CompletionOutput
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    params: SamplingParams


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

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast_params(sampling_params, len(prompt_list))
        encoded = [self._encode(p) for p in prompt_list]
        return self.run_encoded(encoded, params_list, use_tqdm, cache_salt)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        encoded = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, chat_template=chat_template
            )
            encoded.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        params_list = _broadcast_params(sampling_params, len(encoded))
        return self.run_encoded(encoded, params_list, use_tqdm, None)

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
    ) -> list[RequestOutput]:
        parents: list[_Parent] = []
        by_child_id: dict[str, tuple[_Parent, _Child]] = {}
        try:
            for (text, ids), params in zip(encoded, params_list):
                parent = self._add(text, ids, params, cache_salt, by_child_id)
                parents.append(parent)
            self._drive(by_child_id, len(parents), use_tqdm)
        except BaseException:
            for child_id in list(by_child_id):
                self.engine.abort_request(child_id)
            raise
        return [p.output for p in parents]

    def _add(self, text, ids, params, cache_salt, by_child_id) -> _Parent:
        rid = str(next(self._ids))
        parent = _Parent(RequestOutput(request_id=rid, prompt=text, prompt_token_ids=ids))
        for i in range(params.n):
            # Each of the n samples is its own engine request; the prefix cache shares the
            # prompt's KV between them. Seeded samples get distinct, reproducible seeds.
            child_params = params if params.seed is None else replace(params, seed=params.seed + i)
            child_id = f"{rid}-{i}"
            self.engine.add_request(child_id, ids, child_params, cache_salt)
            child = _Child(
                output=CompletionOutput(index=i, text="", token_ids=[]),
                detok=IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens),
                stops=StopStringMatcher(params.stop, params.include_stop_str_in_output),
                params=params,
            )
            if params.logprobs is not None:
                child.output.logprobs = []
                child.output.cumulative_logprob = 0.0
            parent.children.append(child)
            parent.output.outputs.append(child.output)
            parent.unfinished += 1
            by_child_id[child_id] = (parent, child)
        return parent

    def _drive(self, by_child_id, num_requests: int, use_tqdm: bool) -> None:
        bar = tqdm(total=num_requests, desc="Generating", disable=not use_tqdm, unit="req")
        with bar:
            while self.engine.has_unfinished_requests():
                for upd in self.engine.step():
                    parent, child = by_child_id[upd.request_id]
                    if self._apply(parent, child, upd):
                        parent.unfinished -= 1
                        if parent.unfinished == 0:
                            parent.output.finished = True
                            bar.update(1)

    def _apply(self, parent: _Parent, child: _Child, upd: RequestUpdate) -> bool:
        """Folds one step's tokens into the child's output; True when the child finished."""
        out = child.output
        out.token_ids.extend(upd.new_token_ids)
        parent.output.num_cached_tokens = upd.num_cached_tokens
        self._update_metrics(parent.output, upd)
        if out.logprobs is not None:
            for lp in upd.new_logprobs:
                if lp is not None:
                    out.logprobs.append(self._logprob_dict(lp))
                    out.cumulative_logprob += lp.logprob
        emitted, stop = child.stops.feed(child.detok.push(upd.new_token_ids))
        out.text += emitted
        if stop is not None and not upd.finished:
            self.engine.abort_request(upd.request_id)
        if stop is not None:
            out.finish_reason, out.stop_reason = "stop", stop
            return True
        if upd.finished:
            out.text += child.stops.flush()
            out.finish_reason, out.stop_reason = upd.finish_reason, upd.stop_reason
            return True
        return False

    @staticmethod
    def _update_metrics(output: RequestOutput, upd: RequestUpdate) -> None:
        m = output.metrics
        if m is None:
            m = output.metrics = RequestMetrics(arrival_time=upd.arrival_time)
        if upd.first_token_time is not None and (
            m.first_token_time is None or upd.first_token_time < m.first_token_time
        ):
            m.first_token_time = upd.first_token_time
        if upd.finished:
            m.finished_time = time.monotonic()

    def _logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        d = {
            tid: Logprob(v, rank + 1, self.tokenizer.decode([tid], skip_special_tokens=False))
            for rank, (tid, v) in enumerate(lp.top)
        }
        d[lp.token_id] = Logprob(
            lp.logprob, lp.rank, self.tokenizer.decode([lp.token_id], skip_special_tokens=False)
        )
        return d


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not prompts:
        raise ValueError("prompts must not be empty")
    if all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return list(prompts)


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
