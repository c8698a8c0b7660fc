"""LoRA adapters through an engine's OpenAI front (the gateway pinned to it, ``--engine-url``:
the Gateway API pool's data path), real processes: redis-server, one engine with
``--enable-lora --lora-modules``, the router and Pagoda's gateway, and the front beside the
engine. The front learns the engine's adapters from the engine itself (its internal adapter
list, with the internal credential), so an adapter is served and listed there exactly as
through the gateway; a runtime load through the front (``--allow-runtime-lora-updating``)
reaches its engine, behind the gateway's admin keys and path checks.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from tests.faults.helpers import wait_for
from tests.support.lora import admin_post, write_adapter
from tests.support.services import ServiceProcess
from tests.support.stack import PagodaStack, StackOptions

ADMIN, USER = "admin-key", "user-key"
PROMPT = "The capital of France is"


@dataclass
class Served:
    stack: PagodaStack
    front: ServiceProcess
    root: Path


@pytest.fixture(scope="module")
def served(fast_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("adapter-root")
    for name, seed in (("static", 1), ("dyn", 3)):
        write_adapter(fast_model_dir, root / name, seed=seed)
    outside = tmp_path_factory.mktemp("outside")
    write_adapter(fast_model_dir, outside / "secret", seed=4)
    (root / "escape").symlink_to(outside / "secret")
    engine = ["--enable-lora", "--max-loras", "2", "--lora-roots", str(root),
              "--lora-modules", f"static={root / 'static'}"]
    keys = ["--admin-api-key", ADMIN, "--api-key", USER]
    options = StackOptions(engines=1, engine_args=[engine],
                           gateway_args=["--allow-runtime-lora-updating", *keys])
    with PagodaStack(fast_model_dir, options) as stack:
        front = ServiceProcess(
            "services.gateway",
            ["--host", "127.0.0.1", "--engine-url", stack.engines[0].url,
             "--model", f"{stack.model}={fast_model_dir}", "--engines-refresh", "0.5",
             "--allow-runtime-lora-updating", *keys],
            health_path="/ready",
        )
        try:
            front.start()
            yield Served(stack, front, root)
        finally:
            front.stop()


def _client(url: str, key: str = USER) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def _cards(url: str) -> dict[str, tuple[str | None, str | None]]:
    with _client(url) as c:
        return {m.id: (m.parent, m.root) for m in c.models.list().data}


def _admin(url: str, route: str, body: dict, key: str = ADMIN) -> tuple[int, str]:
    return admin_post(url, route, body, key)


def _greedy(url: str, model: str) -> tuple[str, int]:
    with _client(url) as c:
        out = c.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.model == model
    return out.choices[0].text, out.usage.completion_tokens


def test_a_declared_adapter_is_listed_and_served_as_through_the_gateway(served: Served
                                                                        ) -> None:
    gateway, front = served.stack.gateway.url, served.front.url
    wait_for(lambda: "static" in _cards(gateway), 30, "the gateway lists static")
    assert _cards(front) == _cards(gateway)  # the model and its adapter, parent and root
    assert _cards(front)["static"] == (served.stack.model, str(served.root / "static"))
    through_front = _greedy(front, "static")
    assert through_front == _greedy(gateway, "static")  # the adapter applied: same tokens
    assert through_front[0] != _greedy(front, served.stack.model)[0]  # not the base model
    with _client(front) as c:
        chunks = list(c.chat.completions.create(
            model="static", max_tokens=6, temperature=0, stream=True,
            messages=[{"role": "user", "content": "Hello"}]))
        assert chunks[0].model == "static"
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=2)


def test_a_runtime_load_through_the_front_is_checked_as_the_gateways(served: Served) -> None:
    """Attacker view: the front takes the gateway's admin keys and path checks, and the
    engine confines the path to its --lora-roots; only then is the adapter served."""
    front = served.front.url
    load = {"lora_name": "dyn", "lora_path": "dyn"}
    assert _admin(front, "load_lora_adapter", load, key=USER)[0] == 403
    assert _admin(front, "load_lora_adapter", load, key="sk-nobody")[0] == 401
    for path in ("../outside/secret", "escape", "/etc", str(served.root.parent)):
        status, text = _admin(front, "load_lora_adapter", {"lora_name": "x", "lora_path": path})
        assert status == 400 and json.loads(text)["error"]["param"] == "lora_path", (path, text)
    assert "x" not in _cards(front)
    for body in ({"lora_name": "", "lora_path": "dyn"}, {"lora_name": "x"},
                 {"lora_name": ["x"], "lora_path": "dyn"}):
        status, text = _admin(front, "load_lora_adapter", body)
        assert status == 400 and json.loads(text)["error"]["param"] in ("lora_name",
                                                                        "lora_path"), text
    status, text = _admin(front, "load_lora_adapter", load)
    assert (status, text) == (200, "Success: LoRA adapter 'dyn' added successfully.")
    assert _admin(front, "load_lora_adapter", load)[0] == 400  # already loaded
    assert "dyn" in _cards(front)
    # The engine now reports it in its heartbeat too: the gateway serves the same tokens.
    wait_for(lambda: "dyn" in _cards(served.stack.gateway.url), 30, "the gateway lists dyn")
    assert _greedy(front, "dyn") == _greedy(served.stack.gateway.url, "dyn")
    status, text = _admin(front, "unload_lora_adapter", {"lora_name": "dyn"})
    assert (status, text) == (200, "Success: LoRA adapter 'dyn' removed successfully.")
    assert _admin(front, "unload_lora_adapter", {"lora_name": "dyn"})[0] == 404
    with _client(front) as c, pytest.raises(openai.NotFoundError):
        c.completions.create(model="dyn", prompt=PROMPT, max_tokens=2)
