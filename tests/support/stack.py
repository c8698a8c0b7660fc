"""A Pagoda stack of real processes for fault, soak and security tests.

    with PagodaStack(model_dir, engines=2, routers=1) as stack:
        openai.OpenAI(base_url=stack.base_url, api_key="x")...
        stack.engines[0].kill()                  # SIGKILL; stack.restart_engine(0) brings it back
        stack.redis.stop(); stack.redis.start()  # a Redis outage

Every process is real (redis-server, engines, routers, gateway); only the model is small. Use
``fast_model_dir`` (``tests/conftest.py``): a random tiny Llama with SmolLM2's tokenizer and
vocabulary, so a step takes milliseconds and hundreds of requests fit in a test.
"""

from __future__ import annotations

import json
import re
import shutil
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Self

from tests.support.redis_server import RedisServer
from tests.support.services import ServiceProcess, stop_all

FAST_MODEL = "pagoda-tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json", "special_tokens_map.json")


def write_fast_model(tiny_model_dir, default_model_path: Path) -> Path:
    """A random 2-layer Llama with the default model's vocabulary, EOS and tokenizer files, in a
    directory named ``pagoda-tiny``: servable by engine and gateway alike."""
    src = json.loads((default_model_path / "config.json").read_text())
    made = tiny_model_dir(
        "LlamaForCausalLM",
        seed=7,
        vocab_size=src["vocab_size"],
        max_position_embeddings=4096,
        bos_token_id=src.get("bos_token_id"),
        eos_token_id=src.get("eos_token_id"),
        tie_word_embeddings=True,
    )
    out = made.parent / FAST_MODEL
    if not out.exists():
        shutil.copytree(made, out)
        for name in TOKENIZER_FILES:
            if (default_model_path / name).exists():
                shutil.copy(default_model_path / name, out / name)
    return out


@dataclass
class StackOptions:
    engines: int = 2
    routers: int = 1
    policy: str = "prefix"
    num_blocks: int = 512  # per engine, 16 tokens each
    engine_args: list[list[str]] = field(default_factory=list)  # extra args, per engine index
    router_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # extra env for every service
    redis_password: str | None = None


class PagodaStack:
    def __init__(self, model_dir: Path, options: StackOptions | None = None, **kw) -> None:
        self.model_dir = model_dir
        self.options = options or StackOptions(**kw)
        self.model = model_dir.name
        self.redis = RedisServer(password=self.options.redis_password)
        self.engines: list[ServiceProcess] = []
        self.routers: list[ServiceProcess] = []
        self.gateway: ServiceProcess | None = None

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> Self:
        try:
            self.redis.start()
            # Engines load side by side (their start is most of a stack's), and the routers
            # start meanwhile: a router is given the engines' addresses and reads their
            # heartbeats from Redis, so it need not wait for them. The gateway still starts
            # once every router answers (it asks them for engines from its start).
            self.engines = [self._engine(i).launch() for i in range(self.options.engines)]
            self.routers = [self._router().launch() for _ in range(self.options.routers)]
            for p in (*self.engines, *self.routers):
                p.wait_healthy()
            self.gateway = ServiceProcess(
                "services.gateway",
                ["--host", "127.0.0.1", "--router-url", ",".join(r.url for r in self.routers),
                 "--model", f"{self.model}={self.model_dir}", "--engines-refresh", "0.5",
                 *self.options.gateway_args],
                env=self._env(),
            ).start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        # Gateway first, engines last, as before, but side by side: each shutdown (draining,
        # then the interpreter's exit) overlaps the others'.
        stop_all((self.gateway, *self.routers, *self.engines))
        self.redis.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- parts ----------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"{self.gateway.url}/v1"

    def engine_id(self, index: int) -> str:
        return f"engine-{index}"

    def add_engine(self) -> ServiceProcess:
        """Starts one more engine (the next index; a scale-up, or the first from zero) and
        returns it once it is healthy."""
        engine = self._engine(len(self.engines)).start()
        self.engines.append(engine)
        return engine

    def restart_engine(self, index: int) -> ServiceProcess:
        """Starts engine ``index`` again on its old port (after ``kill()`` or ``stop()``)."""
        old = self.engines[index]
        old.stop()
        self.engines[index] = self._engine(index, port=old.port).start()
        return self.engines[index]

    def _env(self) -> dict[str, str]:
        return {"OMP_NUM_THREADS": "1", **self.options.env}

    def _engine(self, index: int, port: int | None = None) -> ServiceProcess:
        extra = self.options.engine_args[index] if index < len(self.options.engine_args) else []
        return ServiceProcess(
            "services.engine.serving.server",
            ["--model", str(self.model_dir), "--engine-id", self.engine_id(index),
             "--redis-url", self.redis.url, "--num-blocks", str(self.options.num_blocks),
             "--heartbeat-interval-s", "0.5", "--heartbeat-ttl-s", "3", *extra],
            port=port,
            env=self._env(),
        )

    def _router(self) -> ServiceProcess:
        engines = ",".join(e.url for e in self.engines)
        return ServiceProcess(
            "services.router",
            ["--host", "127.0.0.1", "--redis-url", self.redis.url, "--policy",
             self.options.policy, "--engines", engines, *self.options.router_args],
            health_path="/ready",
            env=self._env(),
        )


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def scrape(url: str) -> dict[str, float]:
    """A service's ``/metrics`` as ``{"name{labels}": value}`` (and ``{"name": value}`` summed
    over labels)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        out[name + labels] = value
        if labels:
            out[name] = out.get(name, 0.0) + value
    return out
