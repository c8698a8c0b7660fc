"""The internal plane checks who is calling (services/common/internal_auth.py): every engine and
router route but /health, /ready and /metrics needs the internal credential, a wrong or missing
one is a 401 that names nothing secret, two tokens are accepted at once (rotation), a service
refuses to start without one, and ``python -m services.serve`` gives its children one."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.common import internal_auth
from services.common.internal_auth import TOKENS_ENV, InternalCredential, MissingCredential
from services.protocol import engine_api, lora_api
from services.router.config import RouterConfig
from services.router.server import create_app as router_app
from services.serve import child_env
from tests.security.conftest import KEY_A, Reply, http
from tests.support.redis_server import free_port
from tests.support.services import REPO, ServiceProcess, internal_headers, wait_for_log
from tests.support.stack import PagodaStack

OLD = "old-token-Xa81kLm2Qp7Zr4Tw"
NEW = "new-token-Hb35vNc9Ye6Ud0Js"
ENGINE_ROUTES = [("POST", engine_api.GENERATE_PATH), ("POST", engine_api.ABORT_PATH),
                 ("POST", lora_api.LOAD_PATH), ("POST", lora_api.UNLOAD_PATH),
                 ("GET", lora_api.ADAPTERS_PATH),  # adapter names and paths: internal
                 ("GET", "/no-such-route")]  # unknown routes too: no probing without it
ROUTER_ROUTES = [("POST", "/route"), ("GET", "/engines"), ("GET", "/adapters?model=m"),
                 ("POST", "/adapters"), ("DELETE", "/adapters"), ("GET", "/no-such-route")]
OPEN = ["/health", "/metrics"]  # the router's /ready as well, below


def _session_token() -> str:
    return os.environ[TOKENS_ENV].split(",")[0]


def _wrong() -> dict[str, str | None]:
    token = _session_token()
    return {
        "no header": None,
        "wrong token": f"Bearer {OLD}",
        "empty bearer": "Bearer ",
        "other scheme": f"Basic {token}",
        "token plus a character": f"Bearer {token}x",
        "token less a character": f"Bearer {token[:-1]}",
        "a tenant's API key": f"Bearer {KEY_A}",
        "two tokens": f"Bearer {token},{token}",
    }


def _assert_401_names_nothing(r: Reply, sent: str | None, what: str) -> None:
    assert r.status == 401, (what, r.status, r.body)
    assert r.headers.get("WWW-Authenticate") == "Bearer", what
    assert r.body["error"]["message"] == "missing or invalid internal credential", what
    text = str(r.body) + str(r.headers)
    assert _session_token() not in text and OLD not in text, what
    sent_token = (sent or "").partition(" ")[2]
    if len(sent_token) >= 8:  # what the caller sent is not echoed either
        assert sent_token not in text, what


# -- the credential itself ---------------------------------------------------------------------


def test_every_token_is_accepted_the_first_is_sent() -> None:
    cred = InternalCredential((NEW, OLD))
    assert cred.headers() == {"Authorization": f"Bearer {NEW}"}
    assert cred.accepts(f"Bearer {NEW}") and cred.accepts(f"bearer {OLD}")
    for bad in (None, "", "Bearer", f"Basic {NEW}", f"Bearer {NEW}x", f"{NEW}"):
        assert not cred.accepts(bad), bad
    assert NEW not in repr(cred) and OLD not in repr(cred)


def test_tokens_come_from_the_file_then_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"# rotated 2026-12-01\n{NEW}\n\n  {OLD}  \n")
    cred = internal_auth.resolve(str(path), False, "t", environ={})
    assert cred is not None and cred.tokens == (NEW, OLD)
    env_too = internal_auth.resolve(str(path), False, "t", environ={TOKENS_ENV: f"{OLD},{KEY_A}"})
    assert env_too is not None and env_too.tokens == (NEW, OLD, KEY_A)


def test_no_credential_refuses_unless_the_operator_opts_out(
        caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    with pytest.raises(MissingCredential, match="--insecure-no-internal-auth"):
        internal_auth.resolve(None, False, "router", environ={})
    with pytest.raises(MissingCredential, match="internal token file"):
        internal_auth.resolve(str(tmp_path / "absent"), True, "router", environ={})
    (tmp_path / "huge").write_bytes(b"x" * (65 * 1024))
    with pytest.raises(MissingCredential, match="larger than"):
        internal_auth.resolve(str(tmp_path / "huge"), False, "router", environ={})
    with caplog.at_level(logging.WARNING):
        assert internal_auth.resolve(None, True, "router", environ={}) is None
    assert "insecure-no-internal-auth" in caplog.text


def test_a_weak_token_is_refused_without_being_named() -> None:
    for weak in ("q9z-7", "has a space in it, sixteen+"):
        with pytest.raises(MissingCredential) as err:  # so main() exits 2 with the message
            internal_auth.resolve(None, False, "t", environ={TOKENS_ENV: weak})
        assert weak not in str(err.value) and "#1" in str(err.value)


def test_services_refuse_to_start_without_a_credential(fast_model_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != TOKENS_ENV}
    cmds = {
        "router": ["services.router", "--port", str(free_port())],
        "gateway": ["services.gateway", "--port", str(free_port()),
                    "--model", f"m={fast_model_dir}"],
        "engine": ["services.engine.serving.server", "--port", str(free_port()),
                   "--model", str(fast_model_dir)],
    }
    procs = {name: subprocess.Popen([sys.executable, "-m", *cmd], cwd=REPO, env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for name, cmd in cmds.items()}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (name, err[-2000:])
        assert f"{name}: no internal credential" in err and TOKENS_ENV in err, (name, err)


# -- an in-process router with two tokens (rotation) -------------------------------------------


@pytest.mark.asyncio
async def test_router_accepts_both_rotation_tokens(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    session = internal_headers()
    monkeypatch.delenv(TOKENS_ENV)
    (tmp_path / "tokens").write_text(f"{NEW}\n{OLD}\n")
    config = RouterConfig(host="127.0.0.1", port=0, redis_url=f"redis://127.0.0.1:{free_port()}",
                          internal_token_file=str(tmp_path / "tokens"))
    async with TestClient(TestServer(router_app(config))) as client:
        for token in (NEW, OLD):
            resp = await client.get("/engines", headers={"Authorization": f"Bearer {token}"})
            assert resp.status == 200, await resp.text()
        resp = await client.get("/engines", headers=session)  # a token it does not list
        assert resp.status == 401
        for path in ("/health", "/ready", "/metrics"):
            assert (await client.get(path)).status in (200, 503), path  # /ready: not synced
        assert (await client.get("/health")).status == 200


# -- real processes: the package's keyed stack -------------------------------------------------


@pytest.mark.parametrize(("method", "path"), ENGINE_ROUTES)
def test_engine_routes_need_the_credential(keyed_stack: PagodaStack, method: str,
                                           path: str) -> None:
    for what, header in _wrong().items():
        headers = {} if header is None else {"Authorization": header}
        r = http(method, keyed_stack.engines[0].url + path, {}, headers=headers)
        _assert_401_names_nothing(r, header, f"engine {path}: {what}")


@pytest.mark.parametrize(("method", "path"), ROUTER_ROUTES)
def test_router_routes_need_the_credential(keyed_stack: PagodaStack, method: str,
                                           path: str) -> None:
    for what, header in _wrong().items():
        headers = {} if header is None else {"Authorization": header}
        r = http(method, keyed_stack.routers[0].url + path, {}, headers=headers)
        _assert_401_names_nothing(r, header, f"router {path}: {what}")


def test_with_the_credential_the_routes_answer(keyed_stack: PagodaStack) -> None:
    engine, router = keyed_stack.engines[0].url, keyed_stack.routers[0].url
    r = http("POST", engine + engine_api.ABORT_PATH, {"request_id": "nobody"},
             headers=internal_headers())
    assert r.status == 200, r.body
    r = http("GET", router + "/engines", headers=internal_headers())
    assert r.status == 200 and r.body["engines"], r.body
    for url in (engine, router):
        for path in OPEN:
            assert http("GET", url + path).status == 200, (url, path)
    assert http("GET", router + "/ready").status == 200


def test_the_gateway_sends_it_end_to_end(keyed_stack: PagodaStack) -> None:
    """The gateway routes (router /route) and generates (engine /internal/generate) with the
    credential the stack's processes share."""
    body = {"model": keyed_stack.model, "prompt": "hello", "max_tokens": 2}
    r = http("POST", keyed_stack.base_url + "/completions", body, key=KEY_A)
    assert r.status == 200, r.body


def test_a_gateway_with_another_token_is_a_5xx_never_a_401(keyed_stack: PagodaStack) -> None:
    """Mid-rotation, as an operator could get it wrong: a router that accepts both tokens, an
    engine that accepts only the session's, a gateway that sends the other one. The client is
    not at fault: a 503 (no engine would serve it), never a 401 that blames its key."""
    session = _session_token()
    router = ServiceProcess(
        "services.router", ["--host", "127.0.0.1", "--redis-url", keyed_stack.redis.url,
                            "--engines", keyed_stack.engines[0].url],
        env={TOKENS_ENV: f"{session},{NEW}"}, health_path="/ready")
    with router:
        gateway = ServiceProcess(
            "services.gateway", ["--host", "127.0.0.1", "--router-url", router.url,
                                 "--model", f"{keyed_stack.model}={keyed_stack.model_dir}",
                                 "--api-key", KEY_A, "--max-retries", "0"],
            env={TOKENS_ENV: NEW})
        with gateway:
            body = {"model": keyed_stack.model, "prompt": "hello", "max_tokens": 2}
            r = http("POST", gateway.url + "/v1/completions", body, key=KEY_A)
            assert r.status == 503, r.body
            assert NEW not in str(r.body) and session not in str(r.body)
            # The operator reads why in the gateway's log (and never a token there either).
            log = gateway.log_text()
            assert "refused the gateway's internal credential" in log
            assert NEW not in log and session not in log


# -- python -m services.serve -------------------------------------------------------------------


def test_serve_makes_a_token_per_run_unless_given_one() -> None:
    first, second = child_env({"PATH": "/bin"}), child_env({})
    assert len(first[TOKENS_ENV]) >= internal_auth.MIN_TOKEN_CHARS
    assert first[TOKENS_ENV] != second[TOKENS_ENV] and first["PATH"] == "/bin"
    assert child_env({TOKENS_ENV: NEW})[TOKENS_ENV] == NEW


def test_serve_children_require_the_credential_it_made(fast_model_dir: Path) -> None:
    """From outside, as the issue asks: ``python -m services.serve`` with an API key; its
    engine and router refuse callers without serve's own token (the test session's is not it),
    while completions through the gateway work."""
    env = {k: v for k, v in os.environ.items() if k != TOKENS_ENV}
    env["OMP_NUM_THREADS"] = "1"
    port = free_port()
    with tempfile.NamedTemporaryFile(prefix="pagoda-serve-", suffix=".log") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.serve", "--port", str(port), "--engines", "1",
             "--model", str(fast_model_dir), "--api-key", KEY_A, "--num-blocks", "64",
             "--shutdown-timeout", "0"],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log)
        try:
            text = wait_for_log(proc, Path(log.name), "Pagoda is serving", 180)
            engine = re.search(r"engine-0 metrics: (http://\S+)/metrics", text).group(1)
            router = re.search(r"router metrics: (http://\S+)/metrics", text).group(1)
            for url in (engine + engine_api.ABORT_PATH, router + "/route"):
                for headers in ({}, internal_headers()):
                    r = http("POST", url, {"request_id": "x"}, headers=headers)
                    assert r.status == 401, (url, r.status, r.body)
            assert http("GET", engine + "/health").status == 200
            body = {"model": fast_model_dir.name, "prompt": "hello", "max_tokens": 2}
            deadline = time.monotonic() + 60
            while (r := http("POST", f"http://127.0.0.1:{port}/v1/completions", body,
                             key=KEY_A)).status == 503 and time.monotonic() < deadline:
                time.sleep(0.3)  # the router has not seen the engine's heartbeat yet
            assert r.status == 200, r.body
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
