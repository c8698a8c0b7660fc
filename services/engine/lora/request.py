"""How users name adapters: ``LoRARequest`` (the offline API, as vLLM's) and ``LoRAModule``
(``--lora-modules``, both of vLLM's forms). No torch here: the config imports it."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter for a request, as vLLM's: ``LoRARequest("sql", 1, "/adapters/sql")``.

    ``lora_int_id`` is the caller's id for the adapter (positive); the engine keys adapters
    by name (a different path under a known name replaces its weights)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if (not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool)
                or self.lora_int_id < 1):
            raise ValueError(f"lora_int_id must be an integer > 0, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must name the adapter's directory")

    # vLLM's aliases
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One ``--lora-modules`` entry: ``name=path`` or ``{"name", "path", "base_model_name"}``."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoRAModule:
        text = text.strip()
        if text.startswith("{"):
            try:
                obj = json.loads(text)
            except ValueError:
                raise ValueError(f"--lora-modules: invalid JSON {text!r}") from None
            if not isinstance(obj, dict) or set(obj) - {"name", "path", "base_model_name"}:
                raise ValueError('--lora-modules JSON takes "name", "path" and '
                                 f'"base_model_name", got {text!r}')
            name, path, base = obj.get("name"), obj.get("path"), obj.get("base_model_name")
            if not isinstance(base, (str, type(None))):
                raise ValueError(f"--lora-modules: base_model_name must be a string: {text!r}")
        else:
            name, sep, path = text.partition("=")
            base = None
            if not sep:
                raise ValueError(f"--lora-modules expects name=path or JSON, got {text!r}")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"--lora-modules: a name is required: {text!r}")
        if not isinstance(path, str) or not path.strip():
            raise ValueError(f"--lora-modules: a path is required: {text!r}")
        return cls(name.strip(), path.strip(), base)
