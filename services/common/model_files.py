"""A model directory's configuration files, read one way by every service: ``config.json`` and,
when present, ``generation_config.json`` (Hugging Face's layout).

The engine builds its ``ModelConfig`` from them, the gateway its context length, and the
tokenizer (gateway and offline ``LLM``) the ids that end a sequence. Those ids must be the same
set everywhere: the engine stops on them and the gateway hides them from the text, so one rule
lives here, the one vLLM and transformers apply: the union of config.json's ``eos_token_id``
and generation_config.json's, each an int or a list of ints (a chat model often names its
end-of-turn token only in generation_config.json, the base model's EOS only in config.json).

Torch-free and transformers-free (JSON only): the gateway imports it without the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# Names of the context length in config.json, most common first (GPT-2's n_positions...).
_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length")


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """The parsed files. ``generation`` is {} when the directory has no generation_config.json."""

    config: dict[str, Any]
    generation: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, path: str | Path) -> ModelFiles:
        """``FileNotFoundError`` without config.json; ``ValueError`` when a file is not a JSON
        object."""
        path = Path(path)
        config_file = path / CONFIG_FILE
        if not config_file.is_file():
            raise FileNotFoundError(f"no {CONFIG_FILE} in model directory {path}")
        gen_file = path / GENERATION_CONFIG_FILE
        generation = _read_object(gen_file) if gen_file.is_file() else {}
        return cls(_read_object(config_file), generation)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return eos_token_ids(self.config, self.generation)

    def generation_field(self, key: str) -> Any:
        return generation_field(self.config, self.generation, key)

    @property
    def context_length(self) -> int | None:
        return context_length(self.config)


def eos_token_ids(config: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    """The ids that end a sequence: config.json's ``eos_token_id`` then generation_config.json's
    new ones, in order, each once. ``ValueError`` for a value that is not an int or a list of
    them."""
    ids = _token_ids(CONFIG_FILE, config.get("eos_token_id"))
    ids += _token_ids(GENERATION_CONFIG_FILE, generation.get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


def generation_field(config: dict[str, Any], generation: dict[str, Any], key: str) -> Any:
    """A generation default (``bos_token_id``, ``pad_token_id``): generation_config.json's, as
    transformers reads it, else config.json's; a null there falls back (id 0 is valid)."""
    value = generation.get(key)
    return config.get(key) if value is None else value


def context_length(config: dict[str, Any]) -> int | None:
    """The longest sequence the model was trained for: ``max_position_embeddings`` or a common
    alias, from config.json's ``text_config`` when it has one (multimodal checkpoints), else
    from its top level; None when it names none."""
    cfg = config.get("text_config")
    cfg = cfg if isinstance(cfg, dict) else config
    for key in _CONTEXT_KEYS:
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _token_ids(where: str, value: Any) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [] if value is None else [value]
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{where}: eos_token_id must be a token id or a list of them, "
                             f"got {value!r}")
    return tuple(values)


def _read_object(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if isinstance(raw, dict):
        return raw
    raise ValueError(f"{path} must hold a JSON object, got {type(raw).__name__}")
