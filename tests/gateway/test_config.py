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
