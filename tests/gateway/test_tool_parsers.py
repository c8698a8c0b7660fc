"""Tool-call parsers on canned model outputs: whole text and streamed in pieces agree, a call
is sent only whole (never cut arguments), and parallel_tool_calls false keeps one call."""

from __future__ import annotations

import json
import random

import pytest

from services.gateway.tool_parsers import (
    PARSERS,
    CallSequenceParser,
    NamedFunctionParser,
)

WEATHER = {"city": "Paris", "unit": "celsius", "note": "a \"quoted\" } brace"}


def run(parser, text: str, pieces: int | None = None, seed: int = 0):
    """Feeds ``text`` whole (pieces=None) or cut at random places; returns (content, calls as
    (name, arguments)) rebuilt from the deltas, as an OpenAI client does."""
    content, calls = "", {}
    count = max(0, min(pieces or 0, len(text) - 1))
    cuts = sorted(random.Random(seed).sample(range(1, len(text)), count))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    deltas = [parser.feed(c) for c in chunks] + [parser.finish()]
    for d in deltas:
        content += d.content
        for c in d.calls:
            assert c.index not in calls and c.index == len(calls)  # each call once, whole
            json.loads(c.arguments)
            calls[c.index] = {"id": c.id, "name": c.name, "arguments": c.arguments}
    assert [c.arguments for c in parser.calls] == [calls[i]["arguments"] for i in sorted(calls)]
    assert parser.content == content
    return content, [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]


@pytest.mark.parametrize("pieces", [None, 5, 40, 1000])
def test_hermes_content_then_two_calls(pieces) -> None:
    args2 = {"q": "x"}
    first = json.dumps({"name": "get_weather", "arguments": WEATHER})
    text = (f"Let me check.\n<tool_call>\n{first}"
            f"\n</tool_call>\n<tool_call>\n{json.dumps({'arguments': args2, 'name': 'search'})}"
            "\n</tool_call>")
    content, calls = run(PARSERS["hermes"](), text, pieces)
    assert content == "Let me check.\n"
    assert [n for n, _ in calls] == ["get_weather", "search"]
    assert json.loads(calls[0][1]) == WEATHER and json.loads(calls[1][1]) == args2


@pytest.mark.parametrize("pieces", [None, 7])
def test_hermes_plain_text_and_a_lone_angle_bracket(pieces) -> None:
    text = "a < b and <tool is not a call"
    assert run(PARSERS["hermes"](), text, pieces) == (text, [])


def test_hermes_unterminated_call_keeps_its_arguments() -> None:
    content, calls = run(PARSERS["hermes"](), '<tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert content == "" and calls == [("f", '{"a": 1}')]


@pytest.mark.parametrize("pieces", [None, 3, 60])
def test_llama3_json_calls_and_content(pieces) -> None:
    text = ('<|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(WEATHER)
            + '}; {"name": "noop", "parameters": {}}')
    content, calls = run(PARSERS["llama3_json"](), text, pieces)
    assert content == ""
    assert calls == [("get_weather", json.dumps(WEATHER)), ("noop", "{}")]
    assert run(PARSERS["llama3_json"](), "  The answer is 4.", pieces) == ("  The answer is 4.", [])


@pytest.mark.parametrize("pieces", [None, 9, 200])
def test_required_array_and_named_function(pieces) -> None:
    text = json.dumps([{"name": "a", "parameters": {"x": [1, {"y": "]}"}]}},
                       {"name": "b", "parameters": {}}])
    assert run(CallSequenceParser(), text, pieces) == (
        "", [("a", '{"x": [1, {"y": "]}"}]}'), ("b", "{}")])
    assert run(NamedFunctionParser("f"), '{"k": 1}', pieces) == ("", [("f", '{"k": 1}')])


CALLS = [{"name": "a", "parameters": {"x": [1, {"y": "]}"}]}},
         {"name": "b", "parameters": {"city": "Paris"}}]


def test_a_cut_output_never_yields_a_cut_call() -> None:
    """max_tokens can end the output anywhere: at every cut, the calls are exactly the ones
    whose objects closed, each with complete JSON arguments, streamed or not."""
    text = json.dumps(CALLS)
    first_end = text.index("}}") + 2
    for cut in range(len(text) + 1):
        head = text[:cut]
        expected = [("a", json.dumps(CALLS[0]["parameters"]))] if cut >= first_end else []
        if cut >= len(text) - 1:  # the second object closed (the array's "]" may be missing)
            expected.append(("b", json.dumps(CALLS[1]["parameters"])))
        for pieces in (None, 4):
            assert run(CallSequenceParser(), head, pieces, seed=cut) == ("", expected), cut
    for cut in range(len('{"k": [1, 2]}')):
        assert run(NamedFunctionParser("f"), '{"k": [1, 2]}'[:cut]) == ("", [])


@pytest.mark.parametrize("pieces", [None, 6])
def test_hermes_drops_a_cut_last_call_and_bad_arguments(pieces) -> None:
    good = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    assert run(PARSERS["hermes"](), good + '<tool_call>{"name": "g", "arguments": {"b": ',
               pieces) == ("", [("f", '{"a": 1}')])
    assert run(PARSERS["hermes"](), '<tool_call>{"name": "f", "arguments": {a: 1}}</tool_call>'
               + good, pieces) == ("", [("f", '{"a": 1}')])


def test_a_call_without_arguments_takes_an_empty_object() -> None:
    assert run(PARSERS["llama3_json"](), '{"name": "noop"}') == ("", [("noop", "{}")])


@pytest.mark.parametrize("pieces", [None, 9])
def test_parallel_tool_calls_false_keeps_the_first_call(pieces) -> None:
    text = json.dumps(CALLS)
    assert [n for n, _ in run(CallSequenceParser(1), text, pieces)[1]] == ["a"]
    hermes = "".join(f"<tool_call>{json.dumps({'name': c['name'], 'arguments': {}})}</tool_call>"
                     for c in CALLS)
    assert run(PARSERS["hermes"](1), hermes, pieces) == ("", [("a", "{}")])
