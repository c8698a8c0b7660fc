"""``--speculative-config``: vLLM's JSON object, read and checked once, at start.

Keys (vLLM's names): ``method`` (``ngram``: prompt lookup; ``draft_model``: a smaller model of
the target's tokenizer, served inside the same engine), ``num_speculative_tokens`` (drafts per
step), ``prompt_lookup_min`` / ``prompt_lookup_max`` (ngram only: the lengths of the suffix
looked up; both default to 5 when neither is given, one given sets the other), ``model`` (the
draft's HF directory; giving it without ``method`` means ``draft_model``),
``disable_by_batch_size`` (no new drafts while more requests than that are running) and
``draft_tensor_parallel_size`` (1 only: the draft runs unsharded on rank 0).

Anything else is refused with a ``ValueError`` naming the key (``speculative_config.<key>``),
which the engine server turns into exit status 2 and ``LLM(...)`` raises: an unknown key or
method, a number that is not a positive integer, a lookup range upside down, a key of the other
method (``SpeculativeConfig.parse``: the JSON alone), a draft directory without
``config.json``, or a draft whose vocabulary differs from the target's
(``check_draft_matches``: the files, once ``EngineConfig`` knows the target).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from services.common.cli import json_object
from services.common.model_files import ModelFiles

PREFIX = "speculative_config"
_DEFAULT_LOOKUP = 5  # vLLM's, when neither prompt_lookup_min nor prompt_lookup_max is given
_TOKENIZER_FILE = "tokenizer.json"


class SpecMethod(StrEnum):
    NGRAM = "ngram"
    DRAFT_MODEL = "draft_model"


_KEYS = ("method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max",
         "disable_by_batch_size", "draft_tensor_parallel_size")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: SpecMethod
    num_speculative_tokens: int
    model: str | None = None  # draft_model: the draft's HF directory
    prompt_lookup_min: int = 0  # ngram: shortest suffix looked up (0 for draft_model)
    prompt_lookup_max: int = 0  # ngram: longest suffix looked up
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str) -> SpeculativeConfig:
        """From a JSON text (the flag), a dict (``LLM(speculative_config={...})``) or itself."""
        if isinstance(value, SpeculativeConfig):
            return value
        return cls._from_mapping(json_object(value, PREFIX))

    @classmethod
    def _from_mapping(cls, raw: Mapping[str, Any]) -> SpeculativeConfig:
        unknown = sorted(set(raw) - set(_KEYS))
        if unknown:
            raise ValueError(f"{PREFIX}.{unknown[0]} is not a known key (known: "
                             f"{', '.join(_KEYS)})")
        method = _method(raw)
        k = _positive(raw, "num_speculative_tokens", required=True)
        disable = _positive(raw, "disable_by_batch_size")
        tp = _positive(raw, "draft_tensor_parallel_size")
        if tp not in (None, 1):
            raise ValueError(f"{PREFIX}.draft_tensor_parallel_size must be 1 (the draft runs "
                             f"unsharded on rank 0), got {tp}")
        if method is SpecMethod.NGRAM:
            for key in ("model", "draft_tensor_parallel_size"):
                if raw.get(key) is not None:
                    raise ValueError(f"{PREFIX}.{key} applies to method draft_model, not ngram")
            low, high = _lookup_range(raw)
            return cls(method, k, None, low, high, disable)
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if raw.get(key) is not None:
                raise ValueError(f"{PREFIX}.{key} applies to method ngram, not draft_model")
        return cls(method, k, _draft_dir(raw.get("model")), 0, 0, disable)

    def drafts_at(self, num_running: int) -> bool:
        """Whether new drafts are proposed while ``num_running`` requests run."""
        return self.disable_by_batch_size is None or num_running <= self.disable_by_batch_size

    def to_json(self) -> str:
        raw = {"method": str(self.method), "num_speculative_tokens": self.num_speculative_tokens}
        if self.method is SpecMethod.NGRAM:
            raw |= {"prompt_lookup_min": self.prompt_lookup_min,
                    "prompt_lookup_max": self.prompt_lookup_max}
        else:
            raw["model"] = self.model
        if self.disable_by_batch_size is not None:
            raw["disable_by_batch_size"] = self.disable_by_batch_size
        return json.dumps(raw)


def check_draft_matches(spec: SpeculativeConfig, target_dir: str | Path | None) -> None:
    """A draft model must be a model directory and share the target's vocabulary (when the
    target's directory is known): the same ``vocab_size`` and, when both directories carry a
    ``tokenizer.json``, the same token -> id map. ``ValueError`` naming
    ``speculative_config.model`` otherwise."""
    if spec.method is not SpecMethod.DRAFT_MODEL:
        return
    draft = Path(spec.model)
    try:
        d_vocab = ModelFiles.read(draft).config.get("vocab_size")
    except (FileNotFoundError, ValueError) as exc:
        raise ValueError(f"{PREFIX}.model: {exc}") from None
    if target_dir is None:
        return
    target = Path(target_dir)
    t_vocab = ModelFiles.read(target).config.get("vocab_size")
    if d_vocab != t_vocab:
        raise ValueError(f"{PREFIX}.model: the draft's vocabulary ({d_vocab} tokens) differs "
                         f"from the target's ({t_vocab} tokens)")
    d_tok, t_tok = draft / _TOKENIZER_FILE, target / _TOKENIZER_FILE
    if d_tok.is_file() and t_tok.is_file() and _vocab(d_tok) != _vocab(t_tok):
        raise ValueError(f"{PREFIX}.model: the draft's tokenizer maps tokens to other ids than "
                         "the target's")


def _vocab(path: Path) -> dict[str, int]:
    raw = json.loads(path.read_text())
    added = raw.get("added_tokens") or []
    vocab = dict((raw.get("model") or {}).get("vocab") or {})
    vocab.update({t.get("content"): t.get("id") for t in added if isinstance(t, dict)})
    return vocab


def _method(raw: Mapping[str, Any]) -> SpecMethod:
    method = raw.get("method")
    if method is None:
        if raw.get("model") is None:
            raise ValueError(f"{PREFIX}.method is required (ngram or draft_model) when no "
                             "model is given")
        return SpecMethod.DRAFT_MODEL  # as vLLM: a model alone names a draft model
    try:
        return SpecMethod(method)
    except ValueError:
        allowed = ", ".join(m.value for m in SpecMethod)
        raise ValueError(f"{PREFIX}.method must be one of {allowed}, got {method!r}") from None


def _positive(raw: Mapping[str, Any], key: str, required: bool = False) -> int | None:
    value = raw.get(key)
    if value is None:
        if required:
            raise ValueError(f"{PREFIX}.{key} is required")
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{PREFIX}.{key} must be a positive integer, got {value!r}")
    return value


def _lookup_range(raw: Mapping[str, Any]) -> tuple[int, int]:
    low = _positive(raw, "prompt_lookup_min")
    high = _positive(raw, "prompt_lookup_max")
    if low is None and high is None:
        return _DEFAULT_LOOKUP, _DEFAULT_LOOKUP
    low = high if low is None else low
    high = low if high is None else high
    if low > high:
        raise ValueError(f"{PREFIX}.prompt_lookup_min={low} must be <= "
                         f"prompt_lookup_max={high}")
    return low, high


def _draft_dir(model: Any) -> str:
    if not isinstance(model, str) or not model:
        raise ValueError(f"{PREFIX}.model is required for method draft_model (the draft's HF "
                         "directory)")
    return str(Path(model))
