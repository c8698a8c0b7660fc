from __future__ import annotations

import re

import msgpack
import pytest

from services.protocol.messages import EngineHeartbeat, RouteRequest, RouteResponse
from tests.router.util import chain, heartbeat


def test_round_trips() -> None:
    hb = heartbeat("e1", running=3, waiting=2, kv_usage=0.5)
    assert EngineHeartbeat.from_msgpack(hb.to_msgpack()) == hb
    req = RouteRequest("m", chain(3), 49, ["e2"], "req-1")
    assert RouteRequest.from_msgpack(req.to_msgpack()) == req
    resp = RouteResponse("e1", "http://e1:8000", 2, "prefix-hit", "prefix")
    assert RouteResponse.from_msgpack(resp.to_msgpack()) == resp


def test_defaults_and_unknown_fields() -> None:
    data = {"model": "m", "block_hashes": [], "prompt_len": 3, "future_field": 1}
    req = RouteRequest.from_dict(data)
    assert req.exclude == [] and req.request_id is None


def test_heartbeat_optional_max_model_len() -> None:
    d = heartbeat("e1").to_dict()
    assert EngineHeartbeat.from_dict(d).max_model_len is None
    assert EngineHeartbeat.from_dict(d | {"max_model_len": 8192}).max_model_len == 8192


def test_ints_accepted_as_floats() -> None:
    d = heartbeat("e1").to_dict() | {"kv_usage": 1, "timestamp": 5}
    assert EngineHeartbeat.from_dict(d).kv_usage == 1.0


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"block_hashes": [], "prompt_len": 1}, "missing field 'model'"),
        ({"model": "m", "block_hashes": [b"short"], "prompt_len": 1}, "16 raw bytes"),
        ({"model": "m", "block_hashes": "nope", "prompt_len": 1}, "expected a list"),
        ({"model": "m", "block_hashes": [], "prompt_len": "1"}, "expected int"),
        ({"model": "m", "block_hashes": [], "prompt_len": True}, "expected int"),
        ({"model": "m", "block_hashes": [], "prompt_len": -1}, ">= 0"),
        ({"model": "", "block_hashes": [], "prompt_len": 1}, "non-empty"),
        ({"model": "m", "block_hashes": [], "prompt_len": 1, "exclude": [3]}, "exclude[0]"),
        ({"model": None, "block_hashes": [], "prompt_len": 1}, "expected str, got nil"),
        ({"model": "m", "block_hashes": [], "prompt_len": 1, "request_id": 5}, "request_id"),
    ],
)
def test_route_request_rejects_bad_fields(data: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        RouteRequest.from_dict(data)


@pytest.mark.parametrize(
    "change",
    [
        {"kv_usage": 1.5},
        {"running": -1},
        {"url": "ftp://x"},
        {"block_size": 0},
        {"free_blocks": 2000},
        {"timestamp": float("nan")},
        {"engine_id": 7},
        {"max_model_len": 0},
    ],
)
def test_heartbeat_rejects_bad_values(change: dict) -> None:
    with pytest.raises(ValueError, match="EngineHeartbeat"):
        EngineHeartbeat.from_dict(heartbeat("e1").to_dict() | change)


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", b"\x93\x01\x02\x03", msgpack.packb({1: 2}), msgpack.packb("s"), "text"],
)
def test_garbage_never_crashes(payload: object) -> None:
    with pytest.raises(ValueError):
        RouteRequest.from_msgpack(payload)  # type: ignore[arg-type]
