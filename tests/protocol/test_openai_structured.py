"""response_format / structured_outputs / tools parsing: shapes, conflicts, the tool grammars."""

from __future__ import annotations

import json

import pytest

from services.protocol.openai import OpenAIError, parse_chat_request, parse_completion_request

TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
MSGS = [{"role": "user", "content": "hi"}]


def chat(**body):
    return parse_chat_request({"model": "m", "messages": MSGS, **body})


def test_response_format_kinds() -> None:
    assert chat(response_format={"type": "text"}).params.structured_outputs is None
    assert chat(response_format={"type": "json_object"}).params.structured_outputs.json_object
    schema = {"type": "object", "properties": {"x": {"type": "string"}}}
    req = chat(response_format={"type": "json_schema",
                                "json_schema": {"name": "s", "schema": schema, "strict": True}})
    assert json.loads(req.params.structured_outputs.json) == schema
    assert req.constraint.param == "response_format"
    comp = parse_completion_request({"model": "m", "prompt": "x",
                                     "structured_outputs": {"choice": ["a", "b"]}})
    assert comp.params.structured_outputs.choice == ["a", "b"]


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs"),
    ({"structured_outputs": {"bogus": 1}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL, TOOL]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]}, "messages"),
])
def test_bad_fields_are_400s_naming_them(body, param) -> None:
    with pytest.raises(OpenAIError) as exc:
        chat(**body)
    assert exc.value.status == 400 and exc.value.param == param


def test_tool_choice_grammars() -> None:
    req = chat(tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(req.params.structured_outputs.json)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert list(schema["items"]["properties"]) == ["name", "parameters"]  # name streams first
    named = chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "f"}})
    assert json.loads(named.params.structured_outputs.json) == TOOL["function"]["parameters"]
    auto = chat(tools=[TOOL])
    assert auto.constraint.tools.choice == "auto" and auto.params.structured_outputs is None
    with pytest.raises(OpenAIError, match="chat"):
        parse_completion_request({"model": "m", "prompt": "x", "tools": [TOOL]})


def test_history_tool_calls_reach_the_template_as_objects() -> None:
    from services.protocol.openai_structured import template_messages

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    req = chat(messages=[*MSGS, {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "2"}])
    msgs = template_messages(req.messages)
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert msgs[2]["tool_call_id"] == "c1"
