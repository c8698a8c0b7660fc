"""A real router process fed garbage on ``POST /route``: every malformed body is a 400 in
OpenAI's error shape whose ``param`` names the field, never a 500, and the router keeps routing.

Hypothesis draws random bytes, random msgpack structures, valid requests with fields replaced
by garbage, and valid frames with bytes flipped; the hand-written cases cover each check.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import requests
from hypothesis import given
from hypothesis import strategies as st

from services.common.redis_index import KVIndexPublisher, connect
from services.protocol.messages import RouteRequest, RouteResponse
from services.protocol.wire import (
    MAX_EXCLUDE,
    MAX_NAME_CHARS,
    MAX_PROMPT_TOKENS,
    MAX_REQUEST_ID_CHARS,
    BadRequest,
)
from services.router.server import MAX_BODY_BYTES
from tests.router.util import MODEL, chain, heartbeat
from tests.support.msgpack_fuzz import (
    FUZZ,
    check_error,
    flipped_frames,
    msgpack_values,
    report,
)
from tests.support.redis_server import RedisServer
from tests.support.services import ServiceProcess, internal_headers


@pytest.fixture(scope="module")
def router() -> Iterator[ServiceProcess]:
    """A router over its own Redis, where engine "a" serves MODEL (its heartbeat lasts the
    whole module)."""
    with RedisServer() as redis_server:
        asyncio.run(_publish(redis_server.url))
        proc = ServiceProcess(
            "services.router",
            ["--host", "127.0.0.1", "--redis-url", redis_server.url, "--log-level", "warning"],
            health_path="/ready",
            env={"OMP_NUM_THREADS": "1"},
        )
        with proc:
            yield proc


async def _publish(url: str) -> None:
    client = connect(url)
    try:
        await KVIndexPublisher(client).publish_heartbeat(heartbeat("a"), ttl_s=3600)
    finally:
        await client.aclose()


@pytest.fixture(scope="module")
def http() -> Iterator[requests.Session]:
    with requests.Session() as session:
        session.headers.update(internal_headers())
        yield session


def valid(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "block_hashes": chain(2), "prompt_len": 40, "exclude": [],
            "request_id": "r1", **fields}


def post(http: requests.Session, router: ServiceProcess,
         body: bytes) -> tuple[int, dict[str, Any] | bytes]:
    r = http.post(router.url + "/route", data=body, timeout=30)
    if r.headers.get("Content-Type", "").startswith("application/json"):
        return r.status_code, r.json()
    return r.status_code, r.content




def check_answer(http: requests.Session, router: ServiceProcess, body: bytes,
                 seen: Counter[int]) -> None:
    """The router agrees with the parser: what it refuses is a 400 naming the same field;
    what it accepts is routed (200), or refused for want of an engine (503, 409)."""
    status, answer = post(http, router, body)
    seen[status] += 1
    try:
        RouteRequest.from_msgpack(body)
    except BadRequest as exc:
        check_error(status, answer, exc.param)
        return
    assert status in (200, 409, 503), (status, answer)
    if status == 200:
        assert RouteResponse.from_msgpack(answer).engine_id == "a"
    else:
        assert answer["error"]["type"] == "no_engine"


def assert_still_routing(router: ServiceProcess, http: requests.Session) -> None:
    assert router.proc.poll() is None, router.log_tail()
    status, answer = post(http, router, RouteRequest(MODEL, chain(3), 50).to_msgpack())
    assert status == 200, answer
    assert RouteResponse.from_msgpack(answer).engine_id == "a"
    log = router.log_text()
    at = log.find("Traceback")
    assert at < 0, log[max(0, at - 300) : at + 3000]




# -- strategies -----------------------------------------------------------------------------

_INTERESTING = [
    None, True, False, 0, 1, -1, 40, 2**31, 2**63 - 1, 2**64 - 1, -(2**63), 0.0, 1.5, math.nan,
    math.inf, -math.inf, "", "a", MODEL, "http://[::1", "m" * (MAX_NAME_CHARS + 1), b"",
    b"\x00" * 15, b"\x00" * 16, b"\x00" * 17, [], [b"\x00" * 16], [b"\x00" * 15], ["x" * 16],
    [None], [[b"\x00" * 16]], ["a"], [""], ["http://[bad"], ["e"] * (MAX_EXCLUDE + 1), {},
    {"a": 1}, msgpack.ExtType(5, b"ext"),
]
MSGPACK_VALUES = msgpack_values(_INTERESTING, max_binary=20)
_FIELDS = ["model", "block_hashes", "prompt_len", "exclude", "request_id", "unknown_field"]


@st.composite
def mutated_requests(draw: st.DrawFn) -> dict[str, Any]:
    """A valid request with one to three fields replaced by garbage, or deleted."""
    req = valid()
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(_FIELDS))
        if draw(st.integers(0, 9)) == 0:
            req.pop(key, None)
        else:
            req[key] = draw(st.one_of(st.sampled_from(_INTERESTING), MSGPACK_VALUES))
    return req






# -- property tests -------------------------------------------------------------------------


def test_random_bytes_are_400(router: ServiceProcess, http: requests.Session) -> None:
    seen: Counter[int] = Counter()

    @FUZZ
    @given(st.one_of(st.binary(max_size=512), flipped_frames(valid())))
    def check(body: bytes) -> None:
        check_answer(http, router, body, seen)

    check()
    report("random bytes", seen)
    assert_still_routing(router, http)


def test_random_msgpack_structures_are_400(router: ServiceProcess, http: requests.Session) -> None:
    seen: Counter[int] = Counter()

    @FUZZ
    @given(st.one_of(MSGPACK_VALUES, mutated_requests()))
    def check(obj: Any) -> None:
        check_answer(http, router, msgpack.packb(obj), seen)

    check()
    report("random msgpack", seen)
    assert_still_routing(router, http)


# -- hand-written cases -------------------------------------------------------------------


def _with(**fields: Any) -> bytes:
    return msgpack.packb(valid(**fields))


def _without(name: str) -> bytes:
    req = valid()
    del req[name]
    return msgpack.packb(req)


ROUTE_CASES = [
    # (id, body, param the error must name)
    ("empty", b"", None),
    ("not-msgpack", b"\xc1garbage", None),
    ("truncated", msgpack.packb(valid())[:-3], None),
    ("trailing-bytes", msgpack.packb(valid()) + b"\x00", None),
    ("deep-nesting", b"\x91" * 5000 + b"\xc0", None),
    ("array-claims-4G-items", b"\xdd\xff\xff\xff\xff", None),
    ("top-level-list", msgpack.packb([MODEL, [], 40]), None),
    ("int-map-keys", msgpack.packb({1: 2}), None),
    ("no-model", _without("model"), "model"),
    ("model-int", _with(model=5), "model"),
    ("model-empty", _with(model=""), "model"),
    ("model-huge", _with(model="m" * 10_000), "model"),
    ("model-nested", _with(model={"a": [1, {"b": None}]}), "model"),
    ("model-bytes", _with(model=MODEL.encode()), "model"),
    ("no-block-hashes", _without("block_hashes"), "block_hashes"),
    ("block-hashes-str", _with(block_hashes="abc"), "block_hashes"),
    ("block-hash-short", _with(block_hashes=[b"\x00" * 15]), "block_hashes"),
    ("block-hash-long", _with(block_hashes=[b"\x00" * 17]), "block_hashes"),
    ("block-hash-as-str", _with(block_hashes=["0123456789abcdef"]), "block_hashes"),
    ("block-hash-nil", _with(block_hashes=[None]), "block_hashes"),
    ("more-blocks-than-tokens", _with(block_hashes=chain(3), prompt_len=2), "block_hashes"),
    ("no-prompt-len", _without("prompt_len"), "prompt_len"),
    ("prompt-len-negative", _with(prompt_len=-1), "prompt_len"),
    ("prompt-len-bool", _with(prompt_len=True), "prompt_len"),
    ("prompt-len-float", _with(prompt_len=40.0), "prompt_len"),
    ("prompt-len-nan", _with(prompt_len=math.nan), "prompt_len"),
    ("prompt-len-str", _with(prompt_len="40"), "prompt_len"),
    ("prompt-len-uint64-max", _with(prompt_len=2**64 - 1), "prompt_len"),
    ("exclude-str", _with(exclude="a"), "exclude"),
    ("exclude-int", _with(exclude=[5]), "exclude"),
    ("exclude-empty-entry", _with(exclude=[""]), "exclude"),
    ("exclude-bad-url", _with(exclude=["http://[::1"]), "exclude"),
    ("exclude-too-many", _with(exclude=[f"e{i}" for i in range(MAX_EXCLUDE + 1)]), "exclude"),
    ("exclude-huge-entry", _with(exclude=["x" * 10_000]), "exclude"),
    ("request-id-int", _with(request_id=5), "request_id"),
    ("request-id-huge", _with(request_id="r" * 10_000), "request_id"),
    # the engine's limit, to the character (tests/protocol/test_wire_limits.py)
    ("request-id-past-limit", _with(request_id="r" * (MAX_REQUEST_ID_CHARS + 1)), "request_id"),
    ("request-id-empty", _with(request_id=""), "request_id"),
    ("prompt-len-past-limit", _with(prompt_len=MAX_PROMPT_TOKENS + 1), "prompt_len"),
    ("ext-type", _with(prompt_len=msgpack.ExtType(1, b"x")), "prompt_len"),
]


@pytest.mark.parametrize(("body", "param"), [c[1:] for c in ROUTE_CASES],
                         ids=[c[0] for c in ROUTE_CASES])
def test_malformed_route_is_400_naming_the_field(
    router: ServiceProcess, http: requests.Session, body: bytes, param: str | None
) -> None:
    status, answer = post(http, router, body)
    check_error(status, answer, param)


def test_oversized_body_is_413_json(router: ServiceProcess, http: requests.Session) -> None:
    status, answer = post(http, router, b"\x00" * (MAX_BODY_BYTES + 1))
    check_error(status, answer, None, expect_status=413)
    assert_still_routing(router, http)


def test_valid_requests_still_route(router: ServiceProcess, http: requests.Session) -> None:
    """After all the garbage: routed to "a"; an unknown model is a 503, excluding "a" a 409."""
    assert_still_routing(router, http)
    status, answer = post(http, router, _with(model="no-such-model"))
    assert status == 503 and answer["error"]["type"] == "no_engine"
    status, answer = post(http, router, _with(exclude=["a"]))
    assert status == 409 and answer["error"]["type"] == "no_engine"
    status, answer = post(http, router, _with(request_id="r" * MAX_REQUEST_ID_CHARS))
    assert status == 200, answer  # the longest id the engine accepts too


def test_unknown_paths_and_methods_get_json_errors(router: ServiceProcess,
                                                   http: requests.Session) -> None:
    for method, path, status in (("GET", "/nope", 404), ("GET", "/route", 405)):
        resp = http.request(method, router.url + path, timeout=5)
        assert resp.status_code == status
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
