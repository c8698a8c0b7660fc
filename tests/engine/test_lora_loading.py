"""Adapter loading as a service (issue 33): files read as an attacker's, off the engine thread.

A runtime load's files are opened by walking from a root's descriptor: a FIFO named
``adapter_model.safetensors``, ``/dev/zero`` behind a symlink, a header claiming 2**60 bytes,
integer tensors, a file above the size cap, a symlink leaving the roots, ``..`` and an absolute
path elsewhere are each a 400 naming ``lora_path`` within a second, and the engine goes on
serving. Reads run on the loader thread: a running stream keeps producing tokens while a load
is held up. Any failure of a command is an answer (500, 504), never a dead core. Tensor-parallel
workers receive rank 0's tensors: a relative path serves at TP=2 as at TP=1, and an adapter
edited in place after its load does not reach (or crash) the workers.
"""

from __future__ import annotations

import json
import queue
import shutil
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save

from services.engine import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.lora import commands
from services.engine.lora.commands import LOAD, AdapterCommand, AdapterReply
from services.engine.lora.files import LoadTimeout
from services.engine.lora.peft import parse_safetensors
from services.engine.serving.core_loop import Add, CoreLoop, CoreOutputs
from services.protocol.wire import BadRequest
from tests.support.lora import HOSTILE, hostile_root, release_fifo, write_adapter

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
PROMPT = list(range(3, 19))


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> Path:
    return tiny_model_dir("LlamaForCausalLM")


@pytest.fixture(scope="module")
def good(llama: Path, tmp_path_factory) -> Path:
    return write_adapter(llama, tmp_path_factory.mktemp("made") / "good", seed=7)


@pytest.fixture(scope="module")
def root(good: Path, tmp_path_factory) -> Iterator[Path]:
    root = hostile_root(good, tmp_path_factory.mktemp("hostile"))
    yield root
    release_fifo(root / "fifo" / WEIGHTS)


def _engine(model: Path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), enable_lora=True, block_size=8,
                                  num_blocks=64, **kw))


def _greedy(engine: LLMEngine, jobs: list[str | None], n: int = 6) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    reqs = [engine.add_request(f"g{time.monotonic_ns()}-{i}", PROMPT, params, lora_request=lora)
            for i, lora in enumerate(jobs)]
    while engine.has_unfinished_requests():
        engine.step()
    return [list(r.output_token_ids) for r in reqs]


def _load(engine: LLMEngine, name: str, path: str, roots: tuple[str, ...]) -> AdapterReply:
    return commands.run(engine.lora, AdapterCommand(LOAD, name, path, roots))


# --------------------------------------------------------------------------- hostile files


def test_hostile_paths_are_a_400_naming_lora_path_within_a_second(
        llama: Path, root: Path) -> None:
    engine = _engine(llama)
    with open(root / "big" / WEIGHTS, "r+b") as f:  # sparse: just above the default cap
        f.truncate(engine.lora.max_file_bytes + 1)
    roots = (str(root),)
    outside = root.parent / "outside" / "secret"
    cases = {**HOSTILE, "big": "--max-lora-file-bytes", str(outside): "outside the adapter roots"}
    with ThreadPoolExecutor(1) as pool:  # the old code's FIFO read would never return
        for path, why in cases.items():
            start = time.monotonic()
            future = pool.submit(_load, engine, "bad", path, roots)
            try:
                reply = future.result(timeout=5)
            finally:
                release_fifo(root / "fifo" / WEIGHTS)
            took = time.monotonic() - start
            assert (reply.status, reply.param) == (400, "lora_path"), (path, reply)
            assert why in reply.message, (path, reply.message)
            assert took < 1.0, (path, took)
    assert engine.list_loras() == set()
    assert _load(engine, "ok", "ok", roots).status == 200
    base, under = _greedy(engine, [None, "ok"])
    assert base != under  # serving goes on, with the adapter


def test_an_operator_path_follows_links_but_reads_regular_files_only(
        llama: Path, good: Path, tmp_path: Path) -> None:
    from services.engine.lora.request import LoRARequest

    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / CONFIG).symlink_to(good / CONFIG)  # a Hugging Face cache links into its blobs
    (linked / WEIGHTS).symlink_to(good / WEIGHTS)
    device = tmp_path / "device"
    device.mkdir()
    shutil.copy(good / CONFIG, device / CONFIG)
    (device / WEIGHTS).symlink_to("/dev/zero")
    engine = _engine(llama)
    assert engine.add_lora(LoRARequest("linked", 1, str(linked)))
    with pytest.raises(BadRequest, match="not a regular file") as err:
        engine.add_lora(LoRARequest("device", 2, str(device)))
    assert err.value.param == "lora_path"


def test_the_safetensors_reader_checks_every_claim_before_allocating(good: Path) -> None:
    data = (good / WEIGHTS).read_bytes()
    mine = parse_safetensors(bytearray(data))
    theirs = load_file(good / WEIGHTS)
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    for half in (torch.float16, torch.bfloat16):
        t = torch.randn(3, 4).to(half)
        assert torch.equal(parse_safetensors(bytearray(save({"x": t})))["x"], t)

    def blob(header: object, body: bytes = b"") -> bytearray:
        raw = json.dumps(header).encode()
        return bytearray(struct.pack("<Q", len(raw)) + raw + body)

    bad = {
        "short": bytearray(b"\x01\x02"),
        "huge header": bytearray(struct.pack("<Q", 2**63) + b"{}"),
        "not json": bytearray(struct.pack("<Q", 3) + b"{{{"),
        "past the end": blob({"x": {"dtype": "F32", "shape": [2**40], "data_offsets":
                                    [0, 2**42]}}),
        "shape mismatch": blob({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
                               b"\x00" * 8),
        "negative": blob({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}},
                         b"\x00" * 4),
        "reversed": blob({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}},
                         b"\x00" * 4),
        "integers": blob({"x": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}},
                         b"\x00" * 8),
        "booleans": blob({"x": {"dtype": "BOOL", "shape": [1], "data_offsets": [0, 1]}},
                         b"\x00"),
    }
    for what, raw in bad.items():
        with pytest.raises(BadRequest) as err:
            parse_safetensors(raw)
        assert err.value.param == "lora_path", what


# --------------------------------------------------------------------------- off the engine thread


class _Core:
    """A real ``CoreLoop`` on its own thread, its outputs in a queue with when they came."""

    def __init__(self, config: EngineConfig, step_delay_s: float = 0.0) -> None:
        self.outputs: queue.Queue[tuple[float, CoreOutputs]] = queue.Queue()
        self.loop = CoreLoop(config, lambda out: self.outputs.put((time.monotonic(), out)),
                             step_delay_s)
        self.engine = self.loop.load()
        self.thread = threading.Thread(target=self.loop.run, daemon=True)
        self.thread.start()
        self.tokens = 0
        self.token_times: list[float] = []  # one per output with tokens
        self.replies: list[AdapterReply] = []

    def pump(self, until: Callable[[], bool], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            left = deadline - time.monotonic()
            assert left > 0, "timed out"
            try:
                at, out = self.outputs.get(timeout=left)
            except queue.Empty:
                continue
            new = sum(len(u.new_token_ids) for u in out.updates)
            self.tokens += new
            self.token_times += [at] * new
            self.replies.extend(out.replies)

    def close(self) -> None:
        self.loop.stop()
        self.thread.join(30)


def test_a_load_in_progress_does_not_stop_a_running_stream(llama: Path, root: Path) -> None:
    core = _Core(EngineConfig(model=str(llama), enable_lora=True, block_size=8, num_blocks=64),
                 step_delay_s=0.005)
    manager = core.engine.lora
    reading, release = threading.Event(), threading.Event()
    real_read = manager.read
    read_from: list[float] = []

    def slow_read(*args):  # a disk that takes its time (the read itself is the real one)
        read_from.append(time.monotonic())
        reading.set()
        release.wait(60)
        return real_read(*args)

    manager.read = slow_read
    try:
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        core.loop.commands.put(Add("stream", PROMPT, params, None))
        core.pump(lambda: core.tokens >= 2)
        core.loop.commands.put(AdapterCommand(LOAD, "ok", "ok", (str(root),), reply_to=7))
        assert reading.wait(30)

        def during_the_read() -> int:
            return sum(at > read_from[0] for at in core.token_times)

        core.pump(lambda: during_the_read() >= 20)  # tokens go on while the load waits
        assert not core.replies
        release.set()
        core.pump(lambda: bool(core.replies))
        assert [(r.reply_to, r.status) for r in core.replies] == [(7, 200)]
        assert "ok" in core.engine.list_loras()
    finally:
        release.set()
        core.close()


def test_any_failure_of_a_command_is_an_answer(llama: Path, root: Path) -> None:
    engine = _engine(llama)
    roots = (str(root),)
    manager = engine.lora
    for exc, status in ((RuntimeError("boom"), 500), (LoadTimeout("slow disk"), 504),
                        (MemoryError(), 500)):
        def fail(*args, exc=exc):
            raise exc

        manager.read = fail
        reply = _load(engine, "x", "ok", roots)
        assert reply.status == status, reply
    del manager.read
    assert _load(engine, "x", "ok", roots).status == 200  # nothing was left half done
    assert len(_greedy(engine, ["x"])[0]) == 6


# --------------------------------------------------------------------------- tensor parallel


def test_two_ranks_serve_a_relative_path_and_an_adapter_edited_in_place(
        tiny_model_dir, tmp_path: Path) -> None:
    base = tiny_model_dir("Qwen2ForCausalLM")
    root = tmp_path / "root"
    for name, seed in (("a", 61), ("b", 62)):
        write_adapter(base, root / name, seed=seed)
    roots = (str(root),)
    one = _engine(base, max_loras=1, max_cpu_loras=2)
    for name in ("a", "b"):
        assert _load(one, name, name, roots).status == 200
    want = _greedy(one, ["a", None, "b"])
    two = _engine(base, tensor_parallel_size=2, max_loras=1, max_cpu_loras=2)
    try:
        for name in ("a", "b"):  # relative: rank 0 resolves it; a worker would read cwd/a
            assert _load(two, name, name, roots).status == 200
        assert _greedy(two, ["a", None]) == want[:2]
        assert _greedy(two, ["b"]) == want[2:]  # a leaves the slot
        with open(root / "a" / WEIGHTS, "r+b") as f:  # edited in place, same inode
            f.write(b"\xff" * 64)
        assert _greedy(two, ["a"]) == want[:1]  # back into the slot from rank 0's memory
    finally:
        two.close()
