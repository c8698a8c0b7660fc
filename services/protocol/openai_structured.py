"""The request fields that constrain or structure the output: ``response_format``, vLLM's
``structured_outputs``, and ``tools`` / ``tool_choice`` / ``parallel_tool_calls``.

Each is checked for shape here (a 400 naming it); what the output must match becomes one
``StructuredOutputsParams`` for the engine, and ``Constraint.param`` remembers which client
field it came from, so a schema the engine's compiler refuses is a 400 naming that field.

``tool_choice``: ``none`` (tools only shown to the template), ``auto`` (the model decides; the
gateway's ``--tool-call-parser`` reads its calls), ``required`` (a grammar: a JSON array of one
or more ``{"name", "parameters"}`` calls, one when ``parallel_tool_calls`` is false), or a named
function (a grammar: that function's arguments).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from services.protocol.structured_outputs import StructuredOutputsParams

MAX_TOOLS = 128
_NAME = re.compile(r"^[a-zA-Z0-9_.\-]{1,64}$")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# vLLM's structured_outputs knobs that change nothing here (one backend, always enforced).
_IGNORED_VLLM_KEYS = frozenset({"disable_fallback", "disable_additional_properties"})
_ENGINE_FIELD = "structured_outputs"


class FieldError(ValueError):
    """A bad value of one client field; ``param`` names it (the caller turns it into a 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class ToolSpec:
    tools: list[dict[str, Any]]  # OpenAI's [{"type": "function", "function": {...}}]
    choice: str  # "none" | "auto" | "required" | "function"
    function: str | None = None  # the named function, when choice is "function"
    parallel: bool = True

    def parameters(self, name: str) -> dict[str, Any]:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or _EMPTY_PARAMETERS
        raise KeyError(name)


@dataclass(slots=True)
class Constraint:
    """What the engine enforces, and the client field it came from."""

    params: StructuredOutputsParams | None = None
    param: str | None = None  # "response_format" | "structured_outputs" | "tools"
    tools: ToolSpec | None = None  # chat requests with tools
    names: dict[str, str] = field(default_factory=dict)  # engine spec field -> client's

    def client_message(self, message: str) -> str:
        """An engine error about ``structured_outputs.X`` reworded with the client's field."""
        for engine_name, client_name in self.names.items():
            message = message.replace(engine_name, client_name)
        return message


def parse_constraint(body: dict[str, Any], chat: bool) -> Constraint:
    """The output constraint of a request body (``Constraint()`` when there is none)."""
    fmt = _response_format(body.get("response_format"))
    so = _structured_outputs(body.get("structured_outputs"))
    tools = _tools(body) if chat else None
    if not chat:
        for name in ("tools", "tool_choice"):
            if body.get(name) not in (None, [], {}):
                raise FieldError(f"{name} is only supported by /v1/chat/completions", name)
    forced = tools is not None and tools.choice in ("required", "function")
    given = [n for n, v in (("response_format", fmt), ("structured_outputs", so),
                            ("tool_choice", forced or None)) if v is not None]
    if len(given) > 1:
        raise FieldError(f"only one of {' and '.join(given)} may constrain the output", given[1])
    if fmt is not None:
        return Constraint(fmt, "response_format", tools, _names(fmt, "response_format"))
    if so is not None:
        return Constraint(so, "structured_outputs", tools)
    if forced:
        return Constraint(_tool_grammar(tools), "tools", tools,
                          {f"{_ENGINE_FIELD}.json": "tools"})
    return Constraint(tools=tools)


def _names(params: StructuredOutputsParams, field_name: str) -> dict[str, str]:
    if params.json is not None:
        return {f"{_ENGINE_FIELD}.json": f"{field_name}.json_schema.schema"}
    return {_ENGINE_FIELD: field_name}


# -- response_format and structured_outputs ---------------------------------------------------


def _response_format(value: Any) -> StructuredOutputsParams | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise FieldError("response_format must be an object", "response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise FieldError(
            "response_format.type must be one of text, json_object, json_schema; got "
            f"{_shown(kind)}",
            "response_format",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise FieldError("response_format.json_schema must be an object", "response_format")
    schema = spec.get("schema")
    if not isinstance(schema, (dict, bool)) and schema is not None:
        raise FieldError("response_format.json_schema.schema must be an object",
                         "response_format")
    name, strict = spec.get("name"), spec.get("strict")
    if name is not None and not isinstance(name, str):
        raise FieldError("response_format.json_schema.name must be a string", "response_format")
    if strict is not None and not isinstance(strict, bool):
        raise FieldError("response_format.json_schema.strict must be a boolean",
                         "response_format")
    if schema is None or schema is True or schema == {}:
        return StructuredOutputsParams(json_object=True)  # any JSON object, as OpenAI
    if schema is False:
        raise FieldError("response_format.json_schema.schema false accepts nothing",
                         "response_format")
    return StructuredOutputsParams(json=json.dumps(schema))


def _structured_outputs(value: Any) -> StructuredOutputsParams | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise FieldError("structured_outputs must be an object", "structured_outputs")
    raw = {k: v for k, v in value.items() if k not in _IGNORED_VLLM_KEYS}
    if "disable_any_whitespace" in raw:  # vLLM's spelling of the opposite knob
        raw["any_whitespace"] = not raw.pop("disable_any_whitespace")
    raw = {k: v for k, v in raw.items() if v is not None}
    try:
        return StructuredOutputsParams.coerce(raw)
    except (ValueError, TypeError) as exc:
        raise FieldError(str(exc), "structured_outputs") from None


# -- tools --------------------------------------------------------------------------------------


def _tools(body: dict[str, Any]) -> ToolSpec | None:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise FieldError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise FieldError("tool_choice needs tools", "tool_choice")
        return None
    checked = _check_tools(tools)
    names = [t["function"]["name"] for t in checked]
    if choice is None:
        choice = "auto"
    if choice in ("none", "auto", "required"):
        return ToolSpec(checked, choice, None, parallel)
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise FieldError(f"tool_choice names the function {_shown(name)}, which is not in "
                             "tools", "tool_choice")
        return ToolSpec(checked, "function", name, parallel)
    raise FieldError('tool_choice must be "none", "auto", "required" or '
                     '{"type": "function", "function": {"name": ...}}', "tool_choice")


def _check_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise FieldError(f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    out, seen = [], set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(
                fn, dict):
            raise FieldError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}',
                             "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise FieldError(f"tools[{i}].function.name must be 1-64 letters, digits, _ . -",
                             "tools")
        if name in seen:
            raise FieldError(f"tools[{i}].function.name {name!r} is used twice", "tools")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise FieldError(f"tools[{i}].function.parameters must be a JSON schema object",
                             "tools")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise FieldError(f"tools[{i}].function.description must be a string", "tools")
        out.append({"type": "function", "function": fn})
    return out


def _tool_grammar(spec: ToolSpec) -> StructuredOutputsParams:
    """required: ``[{"name": f, "parameters": {...}}, ...]``; a named function: its arguments.
    Keys come in schema order (name first), which is what lets the calls stream."""
    if spec.choice == "function":
        return StructuredOutputsParams(json=json.dumps(spec.parameters(spec.function)))
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]},
                           "parameters": spec.parameters(t["function"]["name"])},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in spec.tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not spec.parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=json.dumps(schema))


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them (as vLLM passes them): an assistant's tool call
    ``arguments`` as an object, not the JSON text OpenAI clients send."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and isinstance(calls, list) and calls:
            m = {**m, "tool_calls": [_template_call(c) for c in calls]}
        out.append(m)
    return out


def _template_call(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_tool_messages(messages: list[dict[str, Any]]) -> None:
    """An assistant's ``tool_calls`` must be calls; a ``tool`` message answers one by id."""
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls is not None:
            if m.get("role") != "assistant" or not isinstance(calls, list):
                raise FieldError(f"messages[{i}].tool_calls must be a list on an assistant "
                                 "message", "messages")
            for call in calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not (
                        isinstance(fn.get("arguments"), (str, dict))):
                    raise FieldError(f"messages[{i}].tool_calls entries need function.name and "
                                     "function.arguments", "messages")
        tool_call_id = m.get("tool_call_id")
        if tool_call_id is not None and not isinstance(tool_call_id, str):
            raise FieldError(f"messages[{i}].tool_call_id must be a string", "messages")
