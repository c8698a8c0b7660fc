"""What a request's output is constrained to: vLLM's ``StructuredOutputsParams``.

Exactly one of ``json`` (a JSON schema, as a dict or its JSON text), ``json_object`` (any JSON
object), ``regex``, ``choice`` (one of these strings) or ``grammar`` (EBNF/GBNF, or Lark) is
set. It rides inside ``SamplingParams`` from the gateway to the engine, which compiles it into
a token grammar (``services.engine.structured``); a spec the grammar compiler refuses is a 400
naming ``structured_outputs`` (the gateway renames it to the client's field).

Torch- and grammar-library-free: a contract, checked for shape here and for meaning by the
engine's compiler.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MAX_SPEC_CHARS = 1_000_000  # a schema or grammar larger than this is a mistake, not a format
MAX_CHOICES = 1024
_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(slots=True, kw_only=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None  # a JSON schema
    json_object: bool = False  # any JSON object (response_format json_object)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF) or Lark
    # JSON kinds: allow any whitespace between tokens. Off by default: one space after ':'
    # and ',' (json.dumps' layout), so a small model cannot wander into endless newlines.
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        set_kinds = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, regex, choice, "
                f"grammar; got {set_kinds or 'none'}"
            )
        self._check_types()

    def _check_types(self) -> None:
        if isinstance(self.json, dict):
            self.json = json.dumps(self.json)  # one canonical form: the cache key and the wire
        if self.json is not None:
            _check_text("structured_outputs.json", self.json)
            try:
                schema = json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema object")
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a boolean")  # noqa: TRY004
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                _check_text(f"structured_outputs.{name}", value)
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or len(self.choice) > MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(
                    f"structured_outputs.choice must be a list of 1 to {MAX_CHOICES} "
                    "non-empty strings"
                )
            self.choice = list(self.choice)
        if not isinstance(self.any_whitespace, bool):
            raise ValueError("structured_outputs.any_whitespace must be a boolean")  # noqa: TRY004

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """What identifies the compiled grammar (the compile cache's key)."""
        value = getattr(self, self.kind)
        return (self.kind, tuple(value) if isinstance(value, list) else value, self.any_whitespace)

    @classmethod
    def coerce(cls, value: Any) -> StructuredOutputsParams | None:
        """None, an instance, or its dict form (the wire's, a client's) -> an instance."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(  # noqa: TRY004
                f"structured_outputs must be an object, got {type(value).__name__}"
            )
        known = set(cls.__dataclass_fields__)
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields: {', '.join(unknown[:8])}")
        return cls(**value)


def _check_text(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string")
    if len(value) > MAX_SPEC_CHARS:
        raise ValueError(f"{name} is longer than {MAX_SPEC_CHARS} characters")
