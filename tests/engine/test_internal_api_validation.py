"""A real engine process fed garbage on its internal API: every malformed ``/internal/generate``
and ``/internal/abort`` body is a 400 in OpenAI's error shape naming the problem, never a 500,
and the engine thread keeps serving (a valid request succeeds afterwards, no KV block leaks).

Hypothesis draws random bytes, random msgpack structures, valid requests with fields replaced
by garbage, and valid frames with bytes flipped; the hand-written cases cover each check.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import requests
from hypothesis import given
from hypothesis import strategies as st

from services.protocol import engine_api
from services.protocol.engine_api import GenerateRequest
from services.protocol.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams
from services.protocol.wire import MAX_REQUEST_ID_CHARS, BadRequest
from tests.support.msgpack_fuzz import (
    FUZZ,
    check_error,
    flipped_frames,
    msgpack_values,
    report,
)
from tests.support.services import ServiceProcess, internal_headers

NUM_BLOCKS = 64
VOCAB = 49152  # SmolLM2's, which fast_model_dir keeps


@pytest.fixture(scope="module")
def engine(fast_model_dir: Path) -> Iterator[ServiceProcess]:
    proc = ServiceProcess(
        "services.engine.serving.server",
        ["--model", str(fast_model_dir), "--num-blocks", str(NUM_BLOCKS),
         "--max-model-len", "1024"],
        env={"OMP_NUM_THREADS": "1"},
    )
    with proc:
        yield proc


@pytest.fixture(scope="module")
def http() -> Iterator[requests.Session]:
    with requests.Session() as session:
        session.headers.update(internal_headers())
        yield session


# -- helpers ------------------------------------------------------------------------------------


def valid(rid: str = "ok", **params: Any) -> dict[str, Any]:
    """A valid request as a plain map (for mutating)."""
    p = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True, **params}
    return {"request_id": rid, "prompt_token_ids": [11, 12, 13, 14, 15], "params": p,
            "cache_salt": None}


def post(http: requests.Session, engine: ServiceProcess, body: bytes,
         path: str = engine_api.GENERATE_PATH) -> tuple[int, dict[str, Any] | None]:
    """Posts ``body``; a 400 returns its JSON. A 200 stream is closed at once (which aborts the
    request in the engine), so an accidentally valid body never runs long."""
    with http.post(engine.url + path, data=body, stream=True, timeout=30) as r:
        if r.status_code == 200:
            return 200, None
        return r.status_code, r.json()




def local_param(body: bytes) -> tuple[bool, str | None]:
    """Whether the parser itself accepts ``body``, and the param it blames if not."""
    try:
        GenerateRequest.from_msgpack(body)
    except BadRequest as exc:
        return False, exc.param
    return True, None


def generate(engine: ServiceProcess, body: bytes) -> list[engine_api.StreamFrame]:
    dec = engine_api.FrameDecoder()
    frames: list[engine_api.StreamFrame] = []
    with requests.post(engine.url + engine_api.GENERATE_PATH, data=body, stream=True,
                       headers=internal_headers(), timeout=60) as r:
        assert r.status_code == 200, r.text
        for chunk in r.iter_content(chunk_size=None):
            frames.extend(dec.feed(chunk))
    return frames


def metrics(engine: ServiceProcess) -> dict[str, float]:
    text = requests.get(engine.url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name.split("{", 1)[0]] = float(value)
    return out


def assert_still_serving(engine: ServiceProcess) -> None:
    """The process is up, a valid request streams to the end, and once nothing runs every KV
    block is free again (the garbage, and the aborted accidental hits, leaked nothing)."""
    assert engine.proc.poll() is None, engine.log_tail()
    frames = generate(engine, GenerateRequest(
        "after", [21, 22, 23], SamplingParams(max_tokens=5, ignore_eos=True)).to_msgpack())
    assert isinstance(frames[-1], engine_api.FinishedFrame), frames
    assert frames[-1].completion_tokens == 5
    deadline = time.monotonic() + 20
    while True:
        m = metrics(engine)
        idle = m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
        if idle and m["pagoda:kv_free_blocks"] == NUM_BLOCKS:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
    log = engine.log_text()
    at = log.find("Traceback")
    assert at < 0, log[max(0, at - 300) : at + 3000]


# -- strategies -----------------------------------------------------------------------------

_INTERESTING = [
    None, True, False, 0, 1, -1, 2, 20, 21, VOCAB - 1, VOCAB, 2**31, 2**63 - 1, 2**63,
    2**64 - 1, -(2**63), 0.0, -0.0, 0.5, 1.0, 1.5, -1.5, 1e-300, 1e308, math.nan, math.inf,
    -math.inf, "", "x", "a" * 300, b"", b"\x00" * 16, [], [1], [-1], [True], [1.5], ["x"],
    [""], [[1]], {}, {"a": 1}, ["s"] * 65, list(range(MAX_STOP_TOKEN_IDS + 1)),
    msgpack.ExtType(5, b"ext"),
]
MSGPACK_VALUES = msgpack_values(_INTERESTING, max_binary=12)
_TOP = ["request_id", "prompt_token_ids", "params", "cache_salt", "unknown_field"]
_PARAMS = [*SamplingParams.__dataclass_fields__, "bogus"]


@st.composite
def mutated_requests(draw: st.DrawFn) -> dict[str, Any]:
    """A valid request with one to three fields replaced by garbage, or deleted."""
    req = valid("fuzz")
    for _ in range(draw(st.integers(1, 3))):
        value = draw(st.one_of(st.sampled_from(_INTERESTING), MSGPACK_VALUES))
        if draw(st.booleans()):
            key, target = draw(st.sampled_from(_TOP)), req
        else:
            key, target = draw(st.sampled_from(_PARAMS)), req.get("params")
            if not isinstance(target, dict):
                continue
        if draw(st.integers(0, 9)) == 0:
            target.pop(key, None)
        else:
            target[key] = value
    return req






def _check_generate(http: requests.Session, engine: ServiceProcess, body: bytes,
                    seen: Counter[int]) -> None:
    status, answer = post(http, engine, body)
    seen[status] += 1
    ok, param = local_param(body)
    if not ok:
        check_error(status, answer, param)
    elif status != 200:  # parsed, but the engine's own limits refused it (vocab, context)
        check_error(status, answer)




# -- property tests -------------------------------------------------------------------------


def test_random_bytes_are_400(engine: ServiceProcess, http: requests.Session) -> None:
    seen: Counter[int] = Counter()

    @FUZZ
    @given(st.one_of(st.binary(max_size=512), flipped_frames(valid("flip"))))
    def check(body: bytes) -> None:
        _check_generate(http, engine, body, seen)

    check()
    report("random bytes", seen)
    assert_still_serving(engine)


def test_random_msgpack_structures_are_400(engine: ServiceProcess, http: requests.Session) -> None:
    seen: Counter[int] = Counter()

    @FUZZ
    @given(st.one_of(MSGPACK_VALUES, mutated_requests()))
    def check(obj: Any) -> None:
        _check_generate(http, engine, msgpack.packb(obj), seen)

    check()
    report("random msgpack", seen)
    assert_still_serving(engine)


def test_random_abort_bodies_are_400(engine: ServiceProcess, http: requests.Session) -> None:
    seen: Counter[int] = Counter()

    @FUZZ
    @given(st.one_of(st.binary(max_size=256), st.text(max_size=64).map(str.encode),
                     MSGPACK_VALUES.map(msgpack.packb)))
    def check(body: bytes) -> None:
        status, answer = post(http, engine, body, engine_api.ABORT_PATH)
        seen[status] += 1
        if status != 200:  # '{"request_id": "x"}' is valid: aborting an unknown id is a no-op
            check_error(status, answer)

    check()
    report("random abort bodies", seen)
    assert_still_serving(engine)


# -- hand-written cases -------------------------------------------------------------------


def _with(top: dict[str, Any] | None = None, **params: Any) -> bytes:
    req = valid("hand")
    req["params"].update(params)
    req.update(top or {})
    return msgpack.packb(req)


def _without(field: str) -> bytes:
    req = valid("hand")
    del req[field]
    return msgpack.packb(req)


GENERATE_CASES = [
    # (id, body, param the error must name)
    ("empty", b"", None),
    ("not-msgpack", b"\xc1garbage", None),
    ("truncated", msgpack.packb(valid())[:-3], None),
    ("trailing-bytes", msgpack.packb(valid()) + b"\x00", None),
    ("deep-nesting", b"\x91" * 5000 + b"\xc0", None),
    ("array-claims-4G-items", b"\xdd\xff\xff\xff\xff", None),
    ("top-level-list", msgpack.packb([1, 2, 3]), None),
    ("top-level-string", msgpack.packb("request"), None),
    ("int-map-keys", msgpack.packb({1: 2}), None),
    ("no-request-id", _without("request_id"), "request_id"),
    ("request-id-int", _with({"request_id": 7}), "request_id"),
    ("request-id-empty", _with({"request_id": ""}), "request_id"),
    ("request-id-huge", _with({"request_id": "r" * 10_000}), "request_id"),
    # the router's limit, to the character (tests/protocol/test_wire_limits.py)
    ("request-id-past-limit", _with({"request_id": "r" * (MAX_REQUEST_ID_CHARS + 1)}),
     "request_id"),
    ("no-prompt", _without("prompt_token_ids"), "prompt_token_ids"),
    ("prompt-empty", _with({"prompt_token_ids": []}), "prompt_token_ids"),
    ("prompt-str", _with({"prompt_token_ids": "hello"}), "prompt_token_ids"),
    ("prompt-map", _with({"prompt_token_ids": {"a": 1}}), "prompt_token_ids"),
    ("prompt-bool", _with({"prompt_token_ids": [1, True]}), "prompt_token_ids"),
    ("prompt-negative", _with({"prompt_token_ids": [1, -5]}), "prompt_token_ids"),
    ("prompt-float", _with({"prompt_token_ids": [1.0]}), "prompt_token_ids"),
    ("prompt-nested", _with({"prompt_token_ids": [[1, 2]]}), "prompt_token_ids"),
    ("prompt-nil", _with({"prompt_token_ids": [None]}), "prompt_token_ids"),
    ("prompt-over-vocab", _with({"prompt_token_ids": [1, VOCAB]}), "prompt_token_ids"),
    ("prompt-uint64-max", _with({"prompt_token_ids": [2**64 - 1]}), "prompt_token_ids"),
    ("prompt-over-context", _with({"prompt_token_ids": [5] * 1024}), "prompt_token_ids"),
    ("prompt-2M-ids", _with({"prompt_token_ids": [5] * 2_000_000}), "prompt_token_ids"),
    ("params-list", _with({"params": [1]}), "params"),
    ("params-false", _with({"params": False}), "params"),
    ("params-unknown", _with(bogus=1), "params"),
    ("params-bytes-key", _with({"params": {b"temperature": 1.0}}), "params"),
    ("params-mixed-unknown-keys", _with({"params": {"bogus": 1, b"raw": 2}}), "params"),
    ("temperature-negative", _with(temperature=-0.5), "temperature"),
    ("temperature-nan", _with(temperature=math.nan), "temperature"),
    ("temperature-inf", _with(temperature=math.inf), "temperature"),
    ("temperature-str", _with(temperature="hot"), "temperature"),
    ("temperature-bool", _with(temperature=True), "temperature"),
    ("top-p-zero", _with(top_p=0.0, temperature=1.0), "top_p"),
    ("top-p-over-one", _with(top_p=1.5, temperature=1.0), "top_p"),
    ("top-k-below-minus-one", _with(top_k=-2), "top_k"),
    ("min-p-over-one", _with(min_p=2.0), "min_p"),
    ("presence-penalty", _with(presence_penalty=3.0), "presence_penalty"),
    ("frequency-penalty-nan", _with(frequency_penalty=math.nan), "frequency_penalty"),
    ("repetition-penalty-zero", _with(repetition_penalty=0.0), "repetition_penalty"),
    ("max-tokens-zero", _with(max_tokens=0), "max_tokens"),
    ("max-tokens-negative", _with(max_tokens=-3), "max_tokens"),
    ("max-tokens-bool", _with(max_tokens=True), "max_tokens"),
    ("max-tokens-float", _with(max_tokens=4.0), "max_tokens"),
    ("max-tokens-over-context", _with(max_tokens=2000), "max_tokens"),
    ("max-tokens-uint64-max", _with(max_tokens=2**64 - 1), "max_tokens"),
    ("min-tokens-over-max", _with(min_tokens=9), "min_tokens"),
    ("n-two", _with(n=2), "n"),
    ("n-zero", _with(n=0), "n"),
    ("seed-float", _with(seed=1.5), "seed"),
    ("seed-str", _with(seed="42"), "seed"),
    ("logprobs-over-cap", _with(logprobs=21), "logprobs"),
    ("logprobs-negative", _with(logprobs=-1), "logprobs"),
    ("stop-65-strings", _with(stop=["s"] * 65), "stop"),
    ("stop-map", _with(stop={"a": 1}), "stop"),
    ("stop-int", _with(stop=5), "stop"),
    ("stop-empty-string", _with(stop=[""]), "stop"),
    ("stop-nested", _with(stop=[["x"]]), "stop"),
    ("stop-token-ids-int", _with(stop_token_ids=5), "stop_token_ids"),
    ("stop-token-ids-str", _with(stop_token_ids="123"), "stop_token_ids"),
    ("stop-token-ids-negative", _with(stop_token_ids=[-1]), "stop_token_ids"),
    ("stop-token-ids-huge-list", _with(stop_token_ids=list(range(100_000))), "stop_token_ids"),
    ("ignore-eos-int", _with(ignore_eos=1), "ignore_eos"),
    ("skip-special-str", _with(skip_special_tokens="yes"), "skip_special_tokens"),
    ("cache-salt-int", _with({"cache_salt": 5}), "cache_salt"),
    ("cache-salt-bytes", _with({"cache_salt": b"salt"}), "cache_salt"),
    ("cache-salt-huge", _with({"cache_salt": "s" * 100_000}), "cache_salt"),
    ("ext-type-value", _with(seed=msgpack.ExtType(1, b"x")), "seed"),
    # vLLM: a non-zero priority without --scheduling-policy priority is refused
    ("priority-without-policy", _with({"priority": 1}), "priority"),
    ("priority-negative-without-policy", _with({"priority": -1}), "priority"),
    ("priority-str", _with({"priority": "1"}), "priority"),
    ("priority-huge", _with({"priority": 2**40}), "priority"),
]


@pytest.mark.parametrize(("body", "param"), [c[1:] for c in GENERATE_CASES],
                         ids=[c[0] for c in GENERATE_CASES])
def test_malformed_generate_is_400_naming_the_field(
    engine: ServiceProcess, http: requests.Session, body: bytes, param: str | None
) -> None:
    status, answer = post(http, engine, body)
    check_error(status, answer, param)


ABORT_CASES = [
    ("empty", b"", None),
    ("not-json", b"{nope", None),
    ("bad-utf8", b"\xff\xfe\xfd", None),
    ("deep-nesting", b"[" * 100_000, None),
    ("list", b"[1, 2]", None),
    ("no-request-id", b"{}", "request_id"),
    ("request-id-int", b'{"request_id": 5}', "request_id"),
    ("request-id-null", b'{"request_id": null}', "request_id"),
    ("request-id-huge", b'{"request_id": "' + b"r" * 5000 + b'"}', "request_id"),
    ("msgpack", msgpack.packb({"request_id": "x"}), None),
]


@pytest.mark.parametrize(("body", "param"), [c[1:] for c in ABORT_CASES],
                         ids=[c[0] for c in ABORT_CASES])
def test_malformed_abort_is_400(
    engine: ServiceProcess, http: requests.Session, body: bytes, param: str | None
) -> None:
    status, answer = post(http, engine, body, engine_api.ABORT_PATH)
    check_error(status, answer, param)


def test_the_longest_request_id_is_served(engine: ServiceProcess) -> None:
    """The router accepts an id of exactly this length too (tests/protocol/test_wire_limits.py),
    and an abort may name it."""
    rid = "r" * MAX_REQUEST_ID_CHARS
    frames = generate(engine, msgpack.packb(valid(rid)))
    assert isinstance(frames[-1], engine_api.FinishedFrame), frames
    body = engine_api.AbortRequest(rid).to_json()
    assert requests.post(engine.url + engine_api.ABORT_PATH, data=body, headers=internal_headers(),
                         timeout=10).ok


def test_garbage_during_a_running_request_leaves_it_untouched(engine: ServiceProcess) -> None:
    """Every hand-written bad body posted while a long request streams: it still completes
    with all its tokens, and the engine is healthy afterwards."""
    prompt = list(range(300, 340))
    body = GenerateRequest("long", prompt, SamplingParams(
        max_tokens=300, temperature=0.0, ignore_eos=True)).to_msgpack()
    result: dict[str, Any] = {}

    def run() -> None:
        result["frames"] = generate(engine, body)

    runner = threading.Thread(target=run)
    runner.start()
    with requests.Session() as http:
        http.headers.update(internal_headers())
        for _, bad, _ in GENERATE_CASES:
            status, _ = post(http, engine, bad)
            assert status == 400
    runner.join(120)
    assert not runner.is_alive()
    frames = result["frames"]
    tokens = [t for f in frames if isinstance(f, engine_api.TokensFrame) for t in f.token_ids]
    assert isinstance(frames[-1], engine_api.FinishedFrame) and frames[-1].finish_reason == "length"
    assert len(tokens) == 300
    alone = generate(engine, body)
    assert [t for f in alone if isinstance(f, engine_api.TokensFrame)
            for t in f.token_ids] == tokens
    assert_still_serving(engine)
