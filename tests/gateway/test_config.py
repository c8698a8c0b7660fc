"""Config, CLI flags and the small pure helpers (auth, salts)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.gateway.auth import ApiKeyAuth, cache_salt_for, tenant_id
from services.gateway.config import GatewayConfig, ModelSpec
from services.protocol.openai import OpenAIError


def test_config_from_args() -> None:
    cfg = GatewayConfig.from_args(
        [
            "--port",
            "9000",
            "--router-url",
            "http://r:8100/",
            "--api-key",
            "a",
            "--api-key",
            "b",
            "--model",
            "m1=/models/one",
            "--model",
            "/models/two",
            "--max-retries",
            "3",
        ],
        environ={"PAGODA_API_KEYS": "c, a,"},
    )
    assert cfg.port == 9000 and cfg.router_url == "http://r:8100"
    assert cfg.api_keys == ("a", "b", "c")
    assert cfg.models == (ModelSpec("m1", "/models/one"), ModelSpec("two", "/models/two"))
    assert cfg.max_retries == 3
    with pytest.raises(ValueError, match="router_url"):
        GatewayConfig(router_url="redis://x")
    with pytest.raises(ValueError, match="unique"):
        GatewayConfig(models=(ModelSpec("a", "/x"), ModelSpec("a", "/y")))
    assert GatewayConfig(pd_disaggregation=True).pd_stream_kv  # streamed KV by default
    assert not GatewayConfig(pd_disaggregation=True, pd_stream_kv=False).pd_stream_kv


def test_runtime_lora_switch_and_admin_keys_from_the_environment() -> None:
    """vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING turns the adapter routes on as the flag does;
    admin keys come from --admin-api-key and $PAGODA_ADMIN_API_KEYS (the chart's Secret)."""
    argv = ["--router-url", "http://r:8100"]
    assert not GatewayConfig.from_args(argv, environ={}).allow_runtime_lora_updating
    for value, on in (("true", True), ("1", True), ("False", False), ("", False)):
        cfg = GatewayConfig.from_args(argv, environ={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": value})
        assert cfg.allow_runtime_lora_updating is on, value
    assert GatewayConfig.from_args([*argv, "--allow-runtime-lora-updating"],
                                   environ={}).allow_runtime_lora_updating
    cfg = GatewayConfig.from_args([*argv, "--admin-api-key", "ops1"],
                                  environ={"PAGODA_ADMIN_API_KEYS": "ops2, ops1,"})
    assert cfg.admin_api_keys == ("ops1", "ops2")


def test_engine_url_pins_the_gateway_to_one_engine_and_excludes_what_needs_a_router(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--engine-url (an engine pod's OpenAI front): no router; a flag that needs one (or other
    engines) is refused at startup with exit 2, the message naming both flags. Runtime LoRA
    loading is not such a flag: it loads on the one engine."""
    cfg = GatewayConfig.from_args(["--engine-url", "http://127.0.0.1:8200/"], environ={})
    assert (cfg.engine_url, cfg.router_url, cfg.router_urls) == (
        "http://127.0.0.1:8200", None, ())
    # Neither flag: the router at its default address, as before the flag.
    cfg = GatewayConfig.from_args([], environ={})
    assert (cfg.engine_url, cfg.router_urls) == (None, ("http://127.0.0.1:8100",))
    pinned = ["--engine-url", "http://127.0.0.1:8200"]
    for extra, named in ((["--router-url", "http://r:8100"], "--router-url"),
                         (["--pd-disaggregation"], "--pd-disaggregation"),
                         (["--flow-control"], "--flow-control")):
        with pytest.raises(SystemExit) as exc:
            GatewayConfig.from_args([*pinned, *extra], environ={})
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--engine-url excludes " + named in err, err
    # vLLM's environment switch counts as the flag.
    for argv, environ in (([*pinned, "--allow-runtime-lora-updating"], {}),
                          (pinned, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})):
        assert GatewayConfig.from_args(argv, environ=environ).allow_runtime_lora_updating
    for bad in ("127.0.0.1:8200", "redis://x:1", "http://e:8200/v1", "http://e:99999"):
        with pytest.raises(SystemExit):
            GatewayConfig.from_args(["--engine-url", bad], environ={})
        assert "--engine-url " in capsys.readouterr().err, bad


def test_cli_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.gateway", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for flag in (
        "--router-url",
        "--engine-url",
        "--api-key",
        "--model",
        "--max-body-bytes",
        "--request-timeout",
        "--max-retries",
        "--block-size",
    ):
        assert flag in out


def test_api_key_auth() -> None:
    auth = ApiKeyAuth(["k1", "k2"])
    assert auth.authenticate("Bearer k2") == tenant_id("k2")
    assert auth.authenticate("bearer  k1 ") == tenant_id("k1")
    for header in (None, "", "Bearer", "Basic k1", "Bearer k3", "Bearer k1k2"):
        with pytest.raises(OpenAIError) as exc:
            auth.authenticate(header)
        assert exc.value.status == 401 and "k1" not in exc.value.message
    assert ApiKeyAuth([]).authenticate(None) is None


def test_cache_salt() -> None:
    assert cache_salt_for(None, None) is None
    assert cache_salt_for(None, "s") == "s"
    t = tenant_id("secret-key")
    assert "secret" not in t and len(t) == 32
    assert cache_salt_for(t, None) == f"tenant:{t}"
    assert cache_salt_for(t, "s") == f"tenant:{t}/s"
    assert cache_salt_for(tenant_id("other"), "s") != cache_salt_for(t, "s")
