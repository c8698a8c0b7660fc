"""The models this gateway serves: tokenizer, context length and block size of each.

Tokenizers come from ``--model NAME=HF_DIR``. The context length is the directory's
``max_position_embeddings`` until the engines report a ``max_model_len`` (the smallest wins);
the block size is ``--block-size`` until the engines report theirs. Which models are *live*
(have engines) is what the router's ``/engines`` said last. A model's ``system_fingerprint`` is
recomputed whenever its block size or context length changes.

A model's LoRA adapters are what its live engines report (``/engines``); a request whose
``model`` names one runs on its base model's engines under that adapter, and hashes its prompt
with the adapter in the chain.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from services.common.model_files import ModelFiles
from services.gateway.config import ModelSpec
from services.gateway.fingerprint import system_fingerprint
from services.gateway.router_client import AdapterInfo, EngineInfo
from services.protocol.block_hash import AdapterKey, HashAlgorithm
from services.protocol.openai import OpenAIError
from services.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ServedModel:
    name: str
    path: str
    tokenizer: Tokenizer
    config_context: int | None  # from the model directory; None = unknown
    block_size: int
    engine_context: int | None = None  # smallest max_model_len the engines reported
    # the engines' block-hash function: prompts are hashed with it, or nothing would match
    hash_algorithm: HashAlgorithm = HashAlgorithm.XXH3_128
    engine_ids: tuple[str, ...] = ()
    created: int = 0
    fingerprint: str = ""  # set by refresh_fingerprint
    # LoRA adapters its engines serve, by name (the version most of them report)
    adapters: dict[str, AdapterInfo] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.refresh_fingerprint()

    @property
    def max_model_len(self) -> int | None:
        known = [c for c in (self.config_context, self.engine_context) if c]
        return min(known) if known else None

    def refresh_fingerprint(self) -> None:
        self.fingerprint = system_fingerprint(self.name, self.path, self.block_size,
                                              self.max_model_len)


def context_length_of(model_dir: str | Path) -> int | None:
    """The directory's context length (``model_files.context_length``); None when unreadable."""
    try:
        return ModelFiles.read(model_dir).context_length
    except (OSError, ValueError):
        return None


def load_tokenizers(specs: Iterable[ModelSpec]) -> dict[str, Tokenizer]:
    """Loads each model's tokenizer (slow: call it off the event loop)."""
    out: dict[str, Tokenizer] = {}
    for spec in specs:
        logger.info("loading tokenizer model=%s path=%s", spec.name, spec.path)
        out[spec.name] = Tokenizer(spec.path)
    return out


@dataclass(slots=True)
class ModelRegistry:
    models: dict[str, ServedModel] = field(default_factory=dict)
    default_block_size: int = 16

    @classmethod
    def build(
        cls,
        specs: Iterable[ModelSpec],
        tokenizers: Mapping[str, Tokenizer],
        block_size: int,
        created: int = 0,
    ) -> ModelRegistry:
        models = {
            s.name: ServedModel(
                name=s.name,
                path=s.path,
                tokenizer=tokenizers[s.name],
                config_context=context_length_of(s.path),
                block_size=block_size,
                created=created,
            )
            for s in specs
        }
        return cls(models, block_size)

    def get(self, name: str) -> ServedModel:
        model = self.models.get(name)
        if model is None:
            model = self._base_of(name)
        if model is None:
            raise OpenAIError(
                f"the model {name!r} does not exist",
                status=404,
                param="model",
                code="model_not_found",
            )
        return model

    def resolve_optional(self, name: object, default: str | None = None) -> ServedModel:
        """A request's model; left out, the ``default`` (``--default-model``) or the only
        served one. With several models and no default it must be named."""
        if name is None and default is not None:
            return self.get(default)
        if name is None and len(self.models) == 1:
            return next(iter(self.models.values()))
        if name is None:
            raise OpenAIError(
                "model is required: this gateway serves several models "
                f"({', '.join(sorted(self.models))})",
                param="model",
            )
        if not isinstance(name, str) or not name:
            raise OpenAIError("model must be a non-empty string", param="model")
        return self.get(name)

    def _base_of(self, adapter: str) -> ServedModel | None:
        return next((m for m in self.models.values() if adapter in m.adapters), None)

    def adapter(self, name: object) -> AdapterKey | None:
        """The adapter a request's ``model`` names (None: a base model, or no model named)."""
        if not isinstance(name, str) or name in self.models:
            return None
        base = self._base_of(name)
        if base is None:
            return None
        return AdapterKey(name, base.adapters[name].version)

    def live(self) -> list[ServedModel]:
        return [m for m in self.models.values() if m.engine_ids]

    def update(self, engines: Iterable[EngineInfo]) -> None:
        """Takes in what the router's /engines said: liveness, block sizes, context limits."""
        by_model: dict[str, list[EngineInfo]] = {}
        for e in engines:
            by_model.setdefault(e.model, []).append(e)
        for name, model in self.models.items():
            mine = by_model.get(name, [])
            model.engine_ids = tuple(sorted(e.engine_id for e in mine))
            model.adapters = _adapters(name, mine)
            if not mine:
                continue
            sizes = Counter(e.block_size for e in mine)
            block_size = sizes.most_common(1)[0][0]
            if len(sizes) > 1:
                logger.warning(
                    "engines of model=%s disagree on block_size=%s; hashing with %d",
                    name,
                    dict(sizes),
                    block_size,
                )
            if block_size != model.block_size:
                logger.info("model=%s block_size=%d (from engines)", name, block_size)
            model.block_size = block_size
            model.hash_algorithm = _agreed(name, "hash_algorithm",
                                           Counter(e.hash_algorithm for e in mine))
            limits = [e.max_model_len for e in mine if e.max_model_len]
            model.engine_context = min(limits) if limits else None
            model.refresh_fingerprint()


def _adapters(model: str, engines: list[EngineInfo]) -> dict[str, AdapterInfo]:
    """Every adapter some engine of ``model`` serves; the version most of them report."""
    seen: dict[str, Counter] = {}
    for e in engines:
        for a in e.adapters:
            seen.setdefault(a.name, Counter())[a] += 1
    out = {}
    for name, versions in seen.items():
        if len({a.version for a in versions}) > 1:
            logger.warning("engines of model=%s serve different weights as adapter %s: %s",
                           model, name, sorted({a.version for a in versions}))
        out[name] = versions.most_common(1)[0][0]
    return out


def _agreed(model: str, what: str, seen: Counter) -> HashAlgorithm:
    """The value most engines of a model report (they should all agree: a warning if not)."""
    value = seen.most_common(1)[0][0]
    if len(seen) > 1:
        logger.warning("engines of model=%s disagree on %s=%s; using %s", model, what,
                       dict(seen), value)
    return value
