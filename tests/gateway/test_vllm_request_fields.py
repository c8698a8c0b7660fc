"""The request fields where Pagoda follows vLLM's OpenAI server, through the real gateway (fake
engines record what reached them): a missing ``model``, the ``developer`` role, list-of-parts
content, top-level ``add_generation_prompt`` / ``continue_final_message``,
``stream_options.continuous_usage_stats``, ``n`` up to ``--max-n``, and ``/version``."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from services.gateway.fingerprint import package_version
from tests.gateway.conftest import MODEL, Stack, StackFactory

pytestmark = pytest.mark.asyncio

USER = {"role": "user", "content": "Capital of France?"}


async def post(stack: Stack, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(stack.url + path, json=body) as resp:
        return resp.status, await resp.json()


def sent_prompt(stack: Stack) -> list[int]:
    return stack.engines["e1"].requests[-1].prompt_token_ids


async def test_missing_model_uses_the_only_one(stack: Stack) -> None:
    stack.engines["e1"].behaviour.script = [42]
    status, body = await post(stack, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert status == 200 and body["model"] == MODEL
    status, body = await post(stack, "/v1/chat/completions", {"messages": [USER]})
    assert status == 200 and body["model"] == MODEL
    status, body = await post(stack, "/tokenize", {"prompt": "hi"})
    assert status == 200 and body["count"] >= 1


async def test_missing_model_with_several_is_400_unless_a_default(
    make_stack: StackFactory,
) -> None:
    several = await make_stack(engines=["e1", ("e2", "other")], models=(MODEL, "other"))
    status, body = await post(several, "/v1/completions", {"prompt": "hi"})
    assert status == 400 and body["error"]["param"] == "model", body
    assert "several models" in body["error"]["message"]
    chosen = await make_stack(engines=["e1", ("e2", "other")], models=(MODEL, "other"),
                              default_model="other")
    chosen.engines["e2"].behaviour.script = [42]
    status, body = await post(chosen, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert status == 200 and body["model"] == "other", body
    assert chosen.engines["e2"].requests and not chosen.engines["e1"].requests
    with pytest.raises(ValueError, match="default-model"):
        await make_stack(default_model="nope")


async def test_developer_role_is_the_system_role(stack: Stack) -> None:
    stack.engines["e1"].behaviour.script = [42]
    await stack.client().chat.completions.create(
        model=MODEL, messages=[{"role": "developer", "content": "Answer in French."}, USER]
    )
    expected = stack.tokenizer.encode_chat(
        [{"role": "system", "content": "Answer in French."}, USER]
    )
    assert sent_prompt(stack) == expected
    text = stack.tokenizer.decode(sent_prompt(stack), skip_special_tokens=False)
    assert text.count("system") == 1 and "SmolLM" not in text  # no default system prompt


async def test_text_parts_are_joined_with_newlines(stack: Stack) -> None:
    stack.engines["e1"].behaviour.script = [42]
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    await stack.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts}]
    )
    assert sent_prompt(stack) == stack.tokenizer.encode_chat(
        [{"role": "user", "content": "first\nsecond"}]
    )


async def test_top_level_template_flags(stack: Stack) -> None:
    stack.engines["e1"].behaviour.script = [42]
    tok = stack.tokenizer
    await post(stack, "/v1/chat/completions",
               {"model": MODEL, "messages": [USER], "add_generation_prompt": False})
    assert sent_prompt(stack) == tok.encode_chat([USER], add_generation_prompt=False)
    assert sent_prompt(stack) != tok.encode_chat([USER])
    # chat_template_kwargs wins over the top-level flag (vLLM's precedence).
    await post(stack, "/v1/chat/completions",
               {"model": MODEL, "messages": [USER], "add_generation_prompt": False,
                "chat_template_kwargs": {"add_generation_prompt": True}})
    assert sent_prompt(stack) == tok.encode_chat([USER])
    partial = [USER, {"role": "assistant", "content": "The capital is"}]
    status, _ = await post(stack, "/v1/chat/completions",
                           {"model": MODEL, "messages": partial, "add_generation_prompt": False,
                            "continue_final_message": True})
    assert status == 200
    text = tok.decode(sent_prompt(stack), skip_special_tokens=False)
    assert text.endswith("The capital is")  # the assistant's turn is left open
    status, body = await post(stack, "/v1/chat/completions",
                              {"model": MODEL, "messages": partial,
                               "continue_final_message": True})
    assert status == 400 and body["error"]["param"] == "continue_final_message"
    status, body = await post(stack, "/tokenize",
                              {"model": MODEL, "messages": [USER],
                               "add_generation_prompt": False})
    assert body["tokens"] == tok.encode_chat([USER], add_generation_prompt=False)


async def test_continuous_usage_stats(stack: Stack) -> None:
    ids = stack.tokenizer.encode("one two three four", add_special_tokens=False)
    stack.engines["e1"].behaviour.script = ids
    stream = await stack.client().completions.create(
        model=MODEL, prompt="x", stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    chunks = [c async for c in stream]
    with_text = [c for c in chunks if c.choices]
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in with_text]
    assert counts == sorted(counts) and counts[-1] == len(ids)
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in with_text)
    # Without it, only the final usage chunk.
    stream = await stack.client().completions.create(
        model=MODEL, prompt="x", stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert [c.usage is not None for c in chunks].count(True) == 1


async def test_n_up_to_the_flag(make_stack: StackFactory) -> None:
    stack = await make_stack()
    stack.engines["e1"].behaviour.script = [42]
    out = await stack.client().completions.create(model=MODEL, prompt="x", n=100, max_tokens=1)
    assert len(out.choices) == 100  # vLLM accepts n=100; the default --max-n is 128
    with pytest.raises(openai.BadRequestError) as err:
        await stack.client().completions.create(model=MODEL, prompt=["x"] * 3, n=100)
    assert err.value.param == "n" and "256" in err.value.message  # prompts x n stays bounded
    small = await make_stack(max_n=4)
    with pytest.raises(openai.BadRequestError) as err:
        await small.client().completions.create(model=MODEL, prompt="x", n=5)
    assert err.value.param == "n" and "at most 4" in err.value.message


async def test_version_is_open(make_stack: StackFactory) -> None:
    stack = await make_stack(api_keys=("secret",))
    async with aiohttp.ClientSession() as s, s.get(stack.url + "/version") as resp:
        assert resp.status == 200
        assert await resp.json() == {"version": package_version()}
