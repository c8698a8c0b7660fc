"""Multi-LoRA end to end through real processes (issue 24): redis-server, two engines started
with ``--enable-lora --lora-modules``, the router and the gateway; the official openai client.

Adapters (made by peft) are served by name through the OpenAI API and listed by
``/v1/models`` with their parent and root; a runtime load through the gateway reaches both
engines (admin key only, paths confined to the adapter root: ``../``, absolute paths and a
symlink that leaves it are refused); an engine that restarts gets the runtime adapter back
from the registry in Redis; unloading removes it everywhere; the router sends paced traffic
for an adapter to the engine holding it and spreads a burst over both.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from services.engine import LLM, SamplingParams
from services.engine.lora.request import LoRARequest
from services.protocol import engine_api
from tests.faults.helpers import wait_for
from tests.support.lora import HOSTILE, add_hostile_files, admin_post, release_fifo, write_adapter
from tests.support.services import internal_headers
from tests.support.stack import PagodaStack, StackOptions, scrape

ADMIN, USER = "admin-key", "user-key"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def root(fast_model_dir: Path, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("adapter-root")
    for name, seed in (("static", 1), ("static2", 2), ("dyn", 3), ("static3", 5)):
        write_adapter(fast_model_dir, root / name, seed=seed)
    outside = tmp_path_factory.mktemp("outside")
    write_adapter(fast_model_dir, outside / "secret", seed=4)
    (root / "escape").symlink_to(outside / "secret")
    add_hostile_files(root / "static", root)  # fifo, zero, absurd, ints
    return root


@pytest.fixture(scope="module")
def stack(fast_model_dir: Path, root: Path) -> Iterator[PagodaStack]:
    engine = ["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "4", "--lora-roots",
              str(root), "--lora-modules", f"static={root / 'static'}",
              json.dumps({"name": "static2", "path": str(root / "static2")}),
              f"static3={root / 'static3'}"]
    gateway = ["--allow-runtime-lora-updating", "--admin-api-key", ADMIN, "--api-key", USER]
    with PagodaStack(fast_model_dir, StackOptions(engines=2, engine_args=[engine, engine],
                                                  gateway_args=gateway)) as s:
        wait_for(lambda: {"static", "static2"} <= _model_ids(s), 30, "adapters listed")
        yield s


def _client(stack: PagodaStack, key: str = USER) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0, timeout=60)


def _model_ids(stack: PagodaStack) -> set[str]:
    return {m.id for m in _client(stack).models.list().data}


def _admin(stack: PagodaStack, route: str, body: dict, key: str = ADMIN) -> tuple[int, str]:
    return admin_post(stack.gateway.url, route, body, key)


def _engine_adapters(stack: PagodaStack, engine_id: str) -> dict[str, int]:
    req = urllib.request.Request(stack.routers[0].url + "/engines", headers=internal_headers())
    with urllib.request.urlopen(req, timeout=5) as resp:
        rows = json.loads(resp.read())["engines"]
    return {a["name"]: a["residency"] for e in rows if e["engine_id"] == engine_id
            for a in e["adapters"]}


def _direct(stack: PagodaStack, index: int, lora: str, prompt: list[int],
            max_tokens: int = 4) -> int:
    """A request straight to engine ``index`` (not routed); returns its HTTP status."""
    body = engine_api.GenerateRequest(f"direct-{time.monotonic_ns()}", prompt,
                                      SamplingParams(max_tokens=max_tokens, temperature=0,
                                                     ignore_eos=True), None, lora)
    req = urllib.request.Request(stack.engines[index].url + engine_api.GENERATE_PATH,
                                 data=body.to_msgpack(), method="POST",
                                 headers={"Content-Type": engine_api.CONTENT_TYPE,
                                          **internal_headers()})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def test_adapters_are_listed_and_served_like_models(stack: PagodaStack, fast_model_dir: Path,
                                                    root: Path) -> None:
    cards = {m.id: m for m in _client(stack).models.list().data}
    assert cards["static"].parent == "pagoda-tiny" and cards["static"].root == str(root / "static")
    assert cards["pagoda-tiny"].parent is None
    c = _client(stack)
    got = c.completions.create(model="static", prompt=PROMPT, max_tokens=8, temperature=0)
    assert got.model == "static"
    base = c.completions.create(model="pagoda-tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    with LLM(str(fast_model_dir), enable_lora=True, num_blocks=64) as llm:
        want = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False,
                            lora_request=LoRARequest("static", 1, str(root / "static")))
    assert got.choices[0].text == want[0].outputs[0].text != base.choices[0].text
    chunks = list(c.chat.completions.create(
        model="static", max_tokens=6, temperature=0, stream=True,
        messages=[{"role": "user", "content": "Hello"}]))
    assert chunks[0].model == "static"
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=2)


def test_the_router_follows_the_adapter_and_spreads_a_burst(stack: PagodaStack) -> None:
    # static2 goes into engine-1's device slot; engine-0 holds it in host memory only. Both
    # engines' recent steps are LoRA decode steps (engine-0's under static), so their step
    # times, which the router weighs as speed, are alike: affinity is what differs. The two
    # run side by side, so a busy machine slows both alike (one after the other, engine-1's
    # steps were once seen 1.4x engine-0's, and the router rightly sent all five to engine-0).
    # Even side by side, a neighbour's burst can still make one engine's recent steps 1.25x
    # the other's (the router's "slower" threshold): then speed, not affinity, decides. So
    # the pair is primed again, up to three rounds, until the paced requests show affinity.
    # A round that sent some to engine-0 put static2 in one of its two slots; static3 then
    # static, one after the other, push it out again (the slots are LRU) before the next round.
    c = _client(stack)
    rounds = []
    for _ in range(3):
        if rounds:
            assert [_direct(stack, 0, name, [1, 2, 3]) for name in ("static3", "static")] \
                == [200, 200]
        with ThreadPoolExecutor(2) as pool:
            primed = pool.map(lambda a: _direct(stack, *a, [1, 2, 3], max_tokens=40),
                              [(1, "static2"), (0, "static")])
            assert list(primed) == [200, 200]
        wait_for(lambda: _engine_adapters(stack, "engine-1").get("static2") == 2, 10,
                 "engine-1 reports static2 in a slot")
        wait_for(lambda: _engine_adapters(stack, "engine-0").get("static2") == 1, 10,
                 "engine-0 holds static2 in host memory only")
        engines = []
        for i in range(5):  # paced traffic; prompts under a block: no prefix to follow
            raw = c.completions.with_raw_response.create(model="static2", prompt=f"Hi {i}",
                                                         max_tokens=2, temperature=0)
            engines.append(raw.headers["x-pagoda-engine"])
            # Paced past a heartbeat (0.5 s): the last request no longer counts as pending.
            time.sleep(0.7)
        rounds.append(engines)
        if set(engines) == {"engine-1"}:
            break
    assert set(rounds[-1]) == {"engine-1"}, rounds

    def one(i: int) -> str:
        raw = c.completions.with_raw_response.create(model="static2", prompt=f"Go {i}",
                                                     max_tokens=48, temperature=0)
        return raw.headers["x-pagoda-engine"]

    with ThreadPoolExecutor(24) as pool:
        burst = list(pool.map(one, range(24)))
    assert {"engine-0", "engine-1"} <= set(burst), burst  # not piled onto one engine


def test_runtime_load_reaches_both_engines_and_only_admins_inside_the_root(
        stack: PagodaStack, root: Path) -> None:
    assert _admin(stack, "load_lora_adapter", {"lora_name": "dyn", "lora_path": "dyn"},
                  key=USER)[0] == 403
    status, text = _admin(stack, "load_lora_adapter", {"lora_name": "dyn", "lora_path": "dyn"})
    assert (status, text) == (200, "Success: LoRA adapter 'dyn' added successfully.")
    for engine_id in ("engine-0", "engine-1"):
        wait_for(lambda e=engine_id: "dyn" in _engine_adapters(stack, e), 10, f"{engine_id}")
    assert "dyn" in _model_ids(stack)
    got = _client(stack).completions.create(model="dyn", prompt=PROMPT, max_tokens=4)
    assert got.model == "dyn" and got.choices[0].text
    status, text = _admin(stack, "load_lora_adapter", {"lora_name": "dyn", "lora_path": "dyn"})
    assert status == 400 and "already been loaded" in text
    # Each refused by both engines within a second (a FIFO, /dev/zero behind a symlink, a
    # header claiming 2**60 bytes, integer tensors, symlinks, paths outside), and they serve on.
    for path in ("/etc", str(root.parent), "fifo", "zero", "absurd", "ints", *HOSTILE):
        start = time.monotonic()
        try:
            status, text = _admin(stack, "load_lora_adapter", {"lora_name": "x",
                                                               "lora_path": path})
        finally:
            release_fifo(root / "fifo" / "adapter_model.safetensors")
        took = time.monotonic() - start
        assert status == 400 and json.loads(text)["error"]["param"] == "lora_path", (path, text)
        assert took < 1.0, (path, took)
    assert "x" not in _model_ids(stack)
    got = _client(stack).completions.create(model="dyn", prompt=PROMPT, max_tokens=4)
    assert got.choices[0].text
    assert _admin(stack, "unload_lora_adapter", {"lora_name": "nope"})[0] == 404


def test_a_restarted_engine_gets_the_runtime_adapter_back(stack: PagodaStack) -> None:
    stack.engines[1].kill()
    stack.restart_engine(1)
    # Up, it reads the registry before its first heartbeat (the router's view of engine-1 may
    # still be the killed one's until then): it serves dyn without anyone loading it again.
    wait_for(lambda: _direct(stack, 1, "dyn", [5, 6, 7]) == 200, 30,
             "the restarted engine serves dyn")
    assert "dyn" in _engine_adapters(stack, "engine-1")


def test_unload_removes_it_everywhere_and_the_metric_says_what_runs(stack: PagodaStack) -> None:
    status, text = _admin(stack, "unload_lora_adapter", {"lora_name": "dyn"})
    assert (status, text) == (200, "Success: LoRA adapter 'dyn' removed successfully.")
    for engine_id in ("engine-0", "engine-1"):
        wait_for(lambda e=engine_id: "dyn" not in _engine_adapters(stack, e), 10, engine_id)
    # The gateway's catalog follows the engines' heartbeats (through the router) at its next
    # refresh; from then on the name is an unknown model, vLLM's 404.
    wait_for(lambda: "dyn" not in _model_ids(stack), 10, "the gateway no longer lists dyn")
    with pytest.raises(openai.NotFoundError):
        _client(stack).completions.create(model="dyn", prompt=PROMPT, max_tokens=2)
    metrics = scrape(stack.engines[0].url)
    info = [k for k in metrics if k.startswith("vllm:lora_requests_info{")]
    assert info and 'max_lora="2"' in info[0], info
