"""Structured outputs and tool calling through real processes and the default model: the
official openai client -> gateway -> router -> engines, grammars compiled and enforced there.
Named to run before test_stack.py, whose last test kills an engine of the shared stack."""

from __future__ import annotations

import json
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from tests.e2e.conftest import MODEL, Stack
from tests.e2e.test_stack import client, wait_for_model
from tests.support.services import ServiceProcess

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}},
                       "required": ["tz"], "additionalProperties": False},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tools."}]


@pytest.fixture(scope="module")
def ready(stack: Stack) -> Stack:
    wait_for_model(stack)
    return stack


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A small object schema whose every instance is short (bounded strings and arrays)."""
    kinds = ["string", "integer", "boolean", "enum", "array", "number"]
    if depth == 0:
        kinds.append("object")
    props: dict[str, Any] = {}
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(kinds)
        if kind == "string":
            s = {"type": "string", "maxLength": rng.randint(1, 12)}
        elif kind == "integer":
            s = {"type": "integer", "minimum": -50, "maximum": rng.randint(0, 1000)}
        elif kind == "enum":
            s = {"enum": rng.sample(["red", "green", "blue", "cyan", "gold"], rng.randint(1, 3))}
        elif kind == "array":
            s = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                 "maxItems": rng.randint(1, 3)}
        elif kind == "number":
            s = {"type": "number", "minimum": 0, "maximum": 10}
        elif kind == "object":
            s = random_schema(rng, depth + 1)
        else:
            s = {"type": kind}
        props[f"{kind}_{i}"] = s
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def test_json_schema_outputs_validate_for_20_generated_schemas(ready: Stack) -> None:
    rng = random.Random(13)
    schemas = [random_schema(rng) for _ in range(20)]
    c = client(ready)

    def ask(i: int) -> tuple[dict, Any]:
        resp = c.chat.completions.create(
            model=MODEL, max_tokens=300, temperature=0.7, seed=i,
            messages=[{"role": "user", "content": "Describe a thing as JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i}", "schema": schemas[i],
                                             "strict": True}},
        )
        return schemas[i], resp.choices[0]

    with ThreadPoolExecutor(10) as pool:
        for schema, choice in pool.map(ask, range(20)):
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_regex_choice_grammar_in_both_apis(ready: Stack) -> None:
    c = client(ready)
    chat = c.chat.completions.create(model=MODEL, max_tokens=120, temperature=0, messages=ASK,
                                     response_format={"type": "json_object"})
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    text = c.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=ASK,
                                     response_format={"type": "text"})
    assert text.choices[0].message.content
    cases = [({"regex": r"[0-9]{3}-[0-9]{4}"}, r"^\d{3}-\d{4}$"),
             ({"choice": ["yes", "no", "maybe"]}, r"^(yes|no|maybe)$"),
             ({"grammar": 'root ::= "The answer is " [0-9]+ "."'}, r"^The answer is \d+\.$")]
    for spec, pattern in cases:
        comp = c.completions.create(model=MODEL, prompt="Answer:", max_tokens=30, temperature=1,
                                    seed=5, extra_body={"structured_outputs": spec})
        assert re.match(pattern, comp.choices[0].text), (spec, comp.choices[0].text)
        assert comp.choices[0].finish_reason == "stop"
        # Seeded, as above: unseeded, an unbounded [0-9]+ may sample digits to max_tokens.
        chat = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=30, seed=5,
                                         extra_body={"structured_outputs": spec})
        assert re.match(pattern, chat.choices[0].message.content), spec


def test_bad_constraints_are_400s_naming_the_field(ready: Stack) -> None:
    c = client(ready)
    bad = [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs"),
        ({"extra_body": {"structured_outputs": {"grammar": "root ::= nothing_defined"}}},
         "structured_outputs"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}},
         "structured_outputs"),
        ({"response_format": {"type": "json_object"},
          "extra_body": {"structured_outputs": {"regex": "a"}}}, "structured_outputs"),
        ({"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": 7}}}}}],
          "tool_choice": "required"}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                               "function": {"name": "missing"}}}, "tool_choice"),
        ({"tools": [WEATHER]}, "tool_choice"),  # auto, and this gateway has no parser
    ]
    for kwargs, param in bad:
        with pytest.raises(openai.BadRequestError) as exc:
            c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, **kwargs)
        assert exc.value.body["param"] == param, (kwargs, exc.value.body)


def reassemble(chunks) -> tuple[str | None, list[dict], str]:
    """A stream's tool calls as an OpenAI client rebuilds them."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    for ch in chunks:
        for choice in ch.choices:
            d = choice.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": tc.id, "name": None, "arguments": ""})
                if tc.id:
                    entry["id"], entry["name"] = tc.id, tc.function.name
                entry["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


def as_dicts(message) -> list[dict]:
    return [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
            for t in message.tool_calls]


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required_always_yields_valid_calls(ready: Stack, parallel: bool) -> None:
    c = client(ready)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}

    def ask(seed: int):
        return c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                         tool_choice="required", parallel_tool_calls=parallel,
                                         max_tokens=200, temperature=1, seed=seed)

    with ThreadPoolExecutor(8) as pool:
        for resp in pool.map(ask, range(8)):
            choice = resp.choices[0]
            assert choice.finish_reason == "tool_calls"
            calls = choice.message.tool_calls
            assert calls and (parallel or len(calls) == 1)
            for call in calls:
                assert call.id.startswith("call_") and call.type == "function"
                jsonschema.validate(json.loads(call.function.arguments),
                                    schemas[call.function.name])


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_tool_calls_reassemble_to_the_whole_response(ready: Stack, tool_choice) -> None:
    c = client(ready)
    kw: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": [WEATHER, TIME],
                          "tool_choice": tool_choice, "max_tokens": 200, "temperature": 0}
    whole = c.chat.completions.create(**kw).choices[0]
    content, calls, finish = reassemble(c.chat.completions.create(stream=True, **kw))
    assert finish == whole.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
    assert content == whole.message.content is None
    strip = [{k: v for k, v in d.items() if k != "id"} for d in as_dicts(whole.message)]
    assert [{k: v for k, v in d.items() if k != "id"} for d in calls] == strip
    if tool_choice != "required":
        assert [d["name"] for d in calls] == ["get_time"]


@pytest.mark.parametrize("max_tokens", [14, 30])
def test_required_calls_cut_by_max_tokens_are_dropped(ready: Stack, max_tokens: int) -> None:
    """Parallel calls on: the output is cut inside a call (greedily the model's first call
    ends after about 40 tokens); what comes back, whole or streamed, is only the calls that
    closed, each valid against its tool, and finish_reason length."""
    c = client(ready)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    kw: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": [WEATHER, TIME],
                          "tool_choice": "required", "max_tokens": max_tokens,
                          "temperature": 0}
    whole = c.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert whole.system_fingerprint and choice.finish_reason == "length"
    assert whole.usage.completion_tokens == max_tokens
    calls = as_dicts(choice.message)
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
    chunks = list(c.chat.completions.create(stream=True, **kw))
    assert all(ch.system_fingerprint == whole.system_fingerprint for ch in chunks)
    _, streamed, finish = reassemble(chunks)
    assert finish == "length"
    assert [{k: v for k, v in d.items() if k != "id"} for d in streamed] == [
        {k: v for k, v in d.items() if k != "id"} for d in calls]


def test_tool_round_trip_through_the_chat_template(ready: Stack) -> None:
    c = client(ready)
    first = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                      tool_choice="required", max_tokens=100, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id,
                "content": json.dumps({"temperature": 21, "unit": "celsius"})}]
    final = c.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER],
                                      tool_choice="none", max_tokens=30, temperature=0)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


@pytest.fixture(scope="module")
def hermes_gateway(ready: Stack, default_model_path) -> ServiceProcess:
    """A second gateway on the same router, with ``--tool-call-parser hermes``."""
    gw = ServiceProcess("services.gateway", [
        "--host", "127.0.0.1", "--router-url", ready.router.url,
        "--model", f"{MODEL}={default_model_path}", "--engines-refresh", "0.5",
        "--tool-call-parser", "hermes", "--shutdown-grace", "1"]).start()
    yield gw
    gw.stop()


def test_auto_tool_choice_parses_hermes_calls_streaming_too(
        ready: Stack, hermes_gateway: ServiceProcess) -> None:
    """The small model does not call tools by itself: a grammar makes it write a Hermes call
    (content first), and the gateway's auto parser must find it, streamed or not."""
    forced = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": '
              '{"city": "Paris", "unit": "celsius"}}\n</tool_call>')
    c = openai.OpenAI(base_url=f"{hermes_gateway.url}/v1", api_key="x", max_retries=0,
                      timeout=120)
    for _ in range(50):  # the new gateway learns the engines from the router
        try:
            c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
            break
        except openai.APIStatusError:
            time.sleep(0.2)
    kw: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": [WEATHER],
                          "max_tokens": 100, "temperature": 0,
                          "extra_body": {"structured_outputs": {"choice": [forced]}}}
    whole = c.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert whole.message.content == "Checking.\n"
    [call] = whole.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    content, calls, finish = reassemble(c.chat.completions.create(stream=True, **kw))
    assert (content, finish) == ("Checking.\n", "tool_calls")
    assert [{k: v for k, v in d.items() if k != "id"} for d in calls] == [
        {"name": "get_weather", "arguments": call.function.arguments}]
    plain = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=8,
                                      temperature=0)
    assert plain.choices[0].finish_reason in ("stop", "length")
    c.close()
