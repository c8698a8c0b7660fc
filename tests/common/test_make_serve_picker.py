"""`make serve EXT_PROC_PORT=N` (issue 35): the variable becomes serve's --ext-proc-port, and serve
starts the router with the picker on that port, on loopback, with the model's tokenizer; the
router's own parser reads the flags back (``make -n`` runs nothing). Each engine gets its OpenAI
front (the gateway pinned to it) and advertises the front's port, which the picker answers:
checked from outside on a real ``python -m services.serve``, the test playing Envoy."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai
import pytest

from services.engine.serving.server_config import configs_from_args
from services.gateway.config import GatewayConfig
from services.router.config import RouterConfig, tokenizer_dirs
from services.serve import args_from, front_flags, router_flags
from tests.common.test_make_serve_lora import _serve_argv
from tests.router import ext_proc_client as ep
from tests.support.redis_server import free_port
from tests.support.services import REPO, wait_for_log

KEY = "sk-serve-picker"


def test_make_serve_starts_the_picker() -> None:
    config, _ = args_from(_serve_argv("EXT_PROC_PORT=9002"))
    assert config.ext_proc_port == 9002
    flags = router_flags(config, 8100, "redis://127.0.0.1:6390/0", ["http://127.0.0.1:8201"],
                         "SmolLM2", Path("/models/SmolLM2"))
    router = RouterConfig.from_args(flags)
    assert (router.host, router.ext_proc_port) == ("127.0.0.1", 9002)
    assert tokenizer_dirs(router.tokenizer) == {"SmolLM2": "/models/SmolLM2"}


def test_without_the_variable_the_picker_is_off() -> None:
    config, _ = args_from(_serve_argv())
    assert config.ext_proc_port == 0
    flags = router_flags(config, 8100, "redis://127.0.0.1:6390/0", [], "m", Path("/m"))
    assert RouterConfig.from_args(flags).ext_proc_port == 0


def test_an_engines_front_is_the_pinned_gateway_with_serves_keys(
        capsys: pytest.CaptureFixture[str]) -> None:
    config, _ = args_from(["--ext-proc-port", "9002", "--api-key", KEY,
                           "--admin-api-key", "sk-ops"])
    front = GatewayConfig.from_args(
        front_flags(config, 8301, "http://127.0.0.1:8201", "m", Path("/m")), environ={})
    assert (front.engine_url, front.port, front.host) == ("http://127.0.0.1:8201", 8301,
                                                          "127.0.0.1")
    assert (front.api_keys, front.admin_api_keys) == ((KEY,), ("sk-ops",))
    assert [(m.name, m.path) for m in front.models] == [("m", "/m")]
    _, server = configs_from_args(["--openai-port", "8301"], env={})
    assert server.openai_port == 8301
    for argv in (["--openai-port", "1"],  # serve sets it per engine
                 ["--ext-proc-port", "9002", "--prefill-engines", "1", "--decode-engines", "1"]):
        with pytest.raises(SystemExit) as exc:
            args_from(argv)
        assert exc.value.code == 2, argv
    err = capsys.readouterr().err
    assert "serve sets --openai-port" in err and "--ext-proc-port excludes" in err, err


async def _pick(port: int, body: bytes, timeout: float) -> list[str]:
    """The endpoints the picker answers, asked as Envoy asks (full duplex); while no engine's
    heartbeat has reached the router yet, the picker's 503 is asked again."""
    deadline = time.monotonic() + timeout
    while True:
        async with ep.ext_proc_stub(port) as stub, ep.stream(stub) as s:
            await s.send(ep.headers(key=KEY), ep.body(body, True))
            answer = await s.read(timeout=60)
        if answer.WhichOneof("response") == "request_headers":
            return ep.header_mutation(answer.request_headers.response)[
                "x-gateway-destination-endpoint"].split(",")
        assert answer.immediate_response.status.code == 503, answer
        assert time.monotonic() < deadline, answer
        await asyncio.sleep(0.5)



def test_serve_picks_each_engines_openai_front(fast_model_dir: Path) -> None:
    """Two engines on one machine: the picker's endpoints are their two fronts (neither the
    engines' internal ports nor the gateway's), and the openai client's chat completion to
    each, streamed and not, succeeds with serve's API key."""
    picker, port = free_port(), free_port()
    model = fast_model_dir.name
    with tempfile.NamedTemporaryFile(prefix="pagoda-serve-", suffix=".log") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.serve", "--port", str(port), "--engines", "2",
             "--model", str(fast_model_dir), "--api-key", KEY, "--ext-proc-port", str(picker),
             "--num-blocks", "64", "--shutdown-timeout", "0"],
            cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
            stderr=log)
        try:
            text = wait_for_log(proc, Path(log.name), "gateway metrics:", 400)
            engines = {int(p) for p in re.findall(r"engine-\d metrics: http://127\.0\.0\.1:(\d+)",
                                                  text)}
            body = ep.chat_body("Name three colors.", model)
            endpoints = asyncio.run(_pick(picker, body, 60))
            ports = {int(e.rpartition(":")[2]) for e in endpoints}
            assert len(ports) == 2 and not ports & (engines | {port}), (endpoints, engines)
            for endpoint in endpoints:
                assert endpoint.startswith("127.0.0.1:")
                with openai.OpenAI(base_url=f"http://{endpoint}/v1", api_key=KEY,
                                   max_retries=0, timeout=60) as c:
                    messages = [{"role": "user", "content": "Name three colors."}]
                    chat = c.chat.completions.create(model=model, messages=messages,
                                                     max_tokens=4, temperature=0)
                    assert chat.choices[0].message.content is not None
                    assert chat.usage.completion_tokens >= 1
                    chunks = list(c.chat.completions.create(
                        model=model, messages=messages, max_tokens=4, temperature=0,
                        stream=True))
                    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks
                                       if ch.choices)
                    assert streamed == chat.choices[0].message.content
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
