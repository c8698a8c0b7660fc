"""Tool calls through the gateway (scripted fake engines, the official openai client): a call
cut off by max_tokens is dropped from the response and from the stream, never sent with
partial or empty arguments, and finish_reason stays "length"; parallel_tool_calls false gives
one call."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.gateway.conftest import MODEL, Stack

pytestmark = pytest.mark.asyncio

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris and Rome?"}]
# What a small model writes under the required grammar with parallel calls on: the same call
# again and again until max_tokens.
REPEATED = json.dumps([{"name": "get_weather", "parameters": {"city": c}}
                       for c in ("Paris", "Rome", "Oslo", "Lima")])


def script(stack: Stack, text: str) -> list[int]:
    ids = stack.tokenizer.encode(text, add_special_tokens=False)
    for engine in stack.engines.values():
        engine.behaviour.script = ids
    return ids


def cut_inside(stack: Stack, ids: list[int], city: str) -> int:
    """A max_tokens that ends the output inside the arguments of the call for ``city``."""
    at = REPEATED.index(f'"{city}"') + 3
    return next(n for n in range(len(ids)) if len(stack.tokenizer.decode(ids[:n])) >= at)


def reassemble(chunks: list[Any]) -> tuple[list[dict[str, str]], str | None]:
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for ch in chunks:
        for choice in ch.choices:
            for tc in choice.delta.tool_calls or []:
                assert tc.index not in calls and tc.id and tc.type == "function"  # whole, once
                json.loads(tc.function.arguments)
                calls[tc.index] = {"name": tc.function.name, "arguments": tc.function.arguments}
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


async def test_a_call_cut_by_max_tokens_is_dropped_in_json_and_in_the_stream(
        stack: Stack) -> None:
    max_tokens = cut_inside(stack, script(stack, REPEATED), "Oslo")
    kw: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": [WEATHER],
                          "tool_choice": "required", "max_tokens": max_tokens}
    whole = (await stack.client().chat.completions.create(**kw)).choices[0]
    assert whole.finish_reason == "length"
    calls = [{"name": t.function.name, "arguments": t.function.arguments}
             for t in whole.message.tool_calls]
    assert [json.loads(c["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    stream = await stack.client().chat.completions.create(stream=True, **kw)
    assert reassemble([c async for c in stream]) == (calls, "length")


async def test_a_first_call_cut_leaves_no_call(stack: Stack) -> None:
    max_tokens = cut_inside(stack, script(stack, REPEATED), "Paris")
    kw: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": [WEATHER],
                          "tool_choice": "required", "max_tokens": max_tokens}
    whole = (await stack.client().chat.completions.create(**kw)).choices[0]
    assert (whole.finish_reason, whole.message.tool_calls) == ("length", [])
    stream = await stack.client().chat.completions.create(stream=True, **kw)
    assert reassemble([c async for c in stream]) == ([], "length")


@pytest.mark.parametrize("stream", [False, True])
async def test_parallel_tool_calls_false_gives_exactly_one_call(
        stack: Stack, stream: bool) -> None:
    script(stack, REPEATED)
    kw: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": [WEATHER],
                          "tool_choice": "required", "parallel_tool_calls": False,
                          "max_tokens": 200}
    if stream:
        chunks = [c async for c in await stack.client().chat.completions.create(stream=True,
                                                                                **kw)]
        calls, finish = reassemble(chunks)
    else:
        choice = (await stack.client().chat.completions.create(**kw)).choices[0]
        calls = [{"name": t.function.name, "arguments": t.function.arguments}
                 for t in choice.message.tool_calls]
        finish = choice.finish_reason
    assert finish == "tool_calls"
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    (req,) = [r for e in stack.engines.values() for r in e.requests]
    schema = json.loads(req.params.structured_outputs.json)  # the grammar: one item at most
    assert (schema["minItems"], schema["maxItems"]) == (1, 1)
