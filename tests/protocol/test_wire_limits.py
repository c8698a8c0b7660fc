"""The router's and the engine's message boundaries agree: one validator (services.protocol.wire)
under one set of limits decodes ``RouteRequest`` (gateway -> router) and ``GenerateRequest``
(gateway -> engine), so the same request id or prompt is accepted by both or refused by both
with a 400 naming the field. The real processes answer the same cases
(tests/router/test_route_validation.py, tests/engine/test_internal_api_validation.py)."""

from __future__ import annotations

import json

import msgpack
import pytest

from services.protocol.engine_api import AbortRequest, GenerateRequest
from services.protocol.messages import RouteRequest
from services.protocol.sampling_params import SamplingParams
from services.protocol.wire import MAX_PROMPT_TOKENS, MAX_REQUEST_ID_CHARS, BadRequest


def route(request_id: object = "r1", prompt_len: int = 4) -> bytes:
    return msgpack.packb({"model": "m", "block_hashes": [], "prompt_len": prompt_len,
                          "request_id": request_id})


def generate(request_id: object = "r1", prompt: list[int] | None = None) -> bytes:
    return msgpack.packb({"request_id": request_id, "prompt_token_ids": prompt or [1, 2, 3, 4]})


def refusal(decode, body: bytes) -> str | None:
    """The field a parser blames for ``body``; "" when it accepts it."""
    try:
        decode(body)
    except BadRequest as exc:
        assert exc.param is not None and str(exc)
        return exc.param
    return ""


@pytest.mark.parametrize(
    ("request_id", "refused"),
    [
        ("r" * MAX_REQUEST_ID_CHARS, False),
        ("r" * (MAX_REQUEST_ID_CHARS + 1), True),
        ("é" * MAX_REQUEST_ID_CHARS, False),  # characters, not bytes
        ("", True),
        (7, True),
        (b"r1", True),
    ],
)
def test_request_id_limits_agree(request_id: object, refused: bool) -> None:
    want = "request_id" if refused else ""
    assert refusal(RouteRequest.from_msgpack, route(request_id)) == want
    assert refusal(GenerateRequest.from_msgpack, generate(request_id)) == want
    if not isinstance(request_id, bytes):  # JSON has no bytes
        abort = json.dumps({"request_id": request_id}).encode()
        assert refusal(AbortRequest.from_json, abort) == want


def test_prompt_length_limits_agree() -> None:
    """One bound for the prompt on both hops: the router's ``prompt_len`` and the engine's
    token list; both refuse one token past it, naming their field."""
    assert refusal(RouteRequest.from_msgpack, route(prompt_len=MAX_PROMPT_TOKENS)) == ""
    assert refusal(RouteRequest.from_msgpack, route(prompt_len=MAX_PROMPT_TOKENS + 1)) \
        == "prompt_len"
    over = [0] * (MAX_PROMPT_TOKENS + 1)
    with pytest.raises(BadRequest, match=f"at most {MAX_PROMPT_TOKENS}") as exc:
        GenerateRequest.from_dict({"request_id": "r", "prompt_token_ids": over})
    assert exc.value.param == "prompt_token_ids"
    del over[-1]
    assert len(GenerateRequest.from_dict({"request_id": "r", "prompt_token_ids": over})
               .prompt_token_ids) == MAX_PROMPT_TOKENS


def test_bounds_are_checked_before_the_contents() -> None:
    """A list past its bound is refused by its length, without walking its items (here a
    list whose every item is wrong: the error is about the length)."""
    with pytest.raises(BadRequest, match="at most") as exc:
        GenerateRequest.from_dict({"request_id": "r",
                                   "prompt_token_ids": ["x"] * (MAX_PROMPT_TOKENS + 1)})
    assert exc.value.param == "prompt_token_ids"


def test_engine_messages_round_trip() -> None:
    req = GenerateRequest("r", [5, 6], SamplingParams(max_tokens=3, logit_bias={5: -1.0},
                                                      stop=["x"]), "salt")
    assert GenerateRequest.from_msgpack(req.to_msgpack()) == req
    assert AbortRequest.from_json(AbortRequest("r").to_json()) == AbortRequest("r")
