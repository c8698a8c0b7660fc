"""GPU throughput: Pagoda offline, batch 1 and through its engine server, against transformers,
on one workload (issue 10's benchmark).

    PYTHONPATH=. python3 benchmarks/gpu_throughput.py --json gpu.json       # < 5 min, one H200
    PYTHONPATH=. python3 benchmarks/gpu_throughput.py --parts server,hf_batch --json more.json
    PYTHONPATH=. .venv/bin/python benchmarks/gpu_throughput.py --device cpu --tiny   # smoke test

Model: a random Llama with Llama-3.2-1B's shape (``LLAMA_1B`` below: hidden 2048, 16 layers,
32 query / 8 KV heads, head_dim 64, intermediate 8192, tied embeddings, Llama 3.2's RoPE) and
SmolLM2's vocabulary (49,152), made by transformers' own init after ``torch.manual_seed(0)``
on the benchmark's device, cast to bf16 and written with ``save_pretrained``. Its context is
4,096 tokens (the longest request is 1,280): transformers warns that RoPE's original 8,192
exceeds it, which is harmless (only the frequencies use it). The tokenizer files come from
``--tokenizer-dir`` (SmolLM2's; no checkpoint is copied to the machine).

Workload (``make_workload``, ``random.Random(0)``): 256 requests, prompts of 64-1024 random
token ids, outputs of 32-256 tokens, ``ignore_eos``, greedy. Every run has the same lengths
and token ids of its own, so no run finds an earlier one's prompts in the prefix cache.

Parts (``--parts``), each in a fresh process, under a time cap and the global ``--budget-s``;
``--json`` is rewritten as each part ends (and during the long ones), so a timeout keeps what
was measured:

  offline    ``LLM(model, max_num_seqs=256, max_num_batched_tokens=8192)``: three runs in one
             process: the first is the cold one (Triton's cache starts empty: ``--kernel-cache``);
             each run lists the Triton kernel variants built during it (none should be)
  batch1     one request (128-token prompt, 256 output tokens): ms per token, cold and warm
  server     ``python -m services.engine.serving.server``, then 256 concurrent streams of
             ``/internal/generate`` (msgpack), twice; failures counted
  server_process  the same with ``--engine-core process`` (the step loop in its own process)
  kernel     ``benchmarks/decode_attention_bench.py --quick``: the 128 x 1024 decode bandwidth
  hf_static  transformers ``generate``, static batches of 64 (left padding, sdpa); only the
             requested tokens count
  hf_batch   transformers ``generate_batch`` (continuous batching), one ``max_new_tokens`` of
             the longest output for all; every generated token counts

Printed: output tok/s per run, Pagoda / each peer, the share of the compute ceiling (the
workload's prompt + output tokens x 2.4 GFLOP at 790 TFLOP/s, as issue 10 counts it), batch-1
ms per token, the kernel's TB/s, the GPU, torch / Triton / transformers versions and the date.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VOCAB = 49_152  # SmolLM2's
SEED = 0
LLAMA3_2_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LLAMA_1B = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 8192,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_parameters": LLAMA3_2_ROPE,
}
TINY = {  # --tiny: the same code paths in seconds on a CPU
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_parameters": LLAMA3_2_ROPE,
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)
ENGINE_ARGS = {"max_num_seqs": 256, "max_num_batched_tokens": 8192}
FLOP_PER_TOKEN = 2.4e9  # ~2 x the 1.2B parameters, as issue 10 counts
PEAK_FLOPS = 790e12  # an H200's dense bf16, as issue 10 counts
# In priority order: a part that would outlast --budget-s is skipped (or cut) at the end.
PARTS = ("offline", "batch1", "server", "server_process", "kernel", "hf_batch", "hf_static")
SERVER_PARTS = {"inline": "server", "process": "server_process"}  # --engine-core: its part
CAPS_S = {  # per part, seconds; the global --budget-s cuts them further
    "model": 60, "offline": 110, "offline_eager": 80, "batch1": 50, "server": 100,
    "server_process": 100,
    "kernel": 45, "hf_static": 60, "hf_batch": 80,
}
MIN_PART_S = 15  # a part with less time left than this is skipped
BATCH1_PROMPT, BATCH1_OUTPUT = 128, 256  # random ids from random.Random(SEED + 1)


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    prompt: list[int]
    output_len: int


def make_workload(tiny: bool, run: int = 0) -> list[Request]:
    """The same lengths every time; the token ids of each ``run`` after the first its own, so
    that a run never finds an earlier run's prompts in the prefix cache (warm means compiled,
    not cached)."""
    rng = random.Random(SEED)
    n, prompts, outputs = (16, (16, 64), (4, 16)) if tiny else (256, (64, 1024), (32, 256))
    work = []
    for _ in range(n):
        prompt_len, output_len = rng.randint(*prompts), rng.randint(*outputs)
        work.append(Request([rng.randrange(VOCAB) for _ in range(prompt_len)], output_len))
    if run:
        ids = random.Random(SEED + 1000 * run)
        work = [Request([ids.randrange(VOCAB) for _ in r.prompt], r.output_len) for r in work]
    return work


def sampling_params(output_len: int) -> Any:
    from services.protocol.sampling_params import SamplingParams

    return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)


# ---------------------------------------------------------------------------------- workers
# Each runs in its own process (``--worker NAME``) and reports through ``Report``.


class Report:
    """A worker's result, rewritten to its file at every update: a killed worker keeps what
    it had measured."""

    def __init__(self, path: Path) -> None:
        self.path, self.data = path, {}

    def update(self, **fields: Any) -> None:
        self.data.update(fields)
        write_json(self.path, self.data)


def worker_model(args: argparse.Namespace, report: Report) -> None:
    """Makes the model (unless ``--model-dir`` already holds one) and reports the machine."""
    import torch
    import transformers

    start = time.perf_counter()
    reused = Path(args.model_dir, "config.json").exists()
    params = None if reused else make_model(args)
    config = json.loads(Path(args.model_dir, "config.json").read_text())
    report.update(
        seconds=time.perf_counter() - start,
        reused=reused,
        params=params,
        rope=config.get("rope_parameters") or config.get("rope_scaling"),
        device=device_name(args.device),
        torch=torch.__version__,
        triton=module_version("triton"),
        transformers=transformers.__version__,
    )


def make_model(args: argparse.Namespace) -> int:
    """Writes the model and tokenizer to ``--model-dir``; returns the parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **(TINY if args.tiny else LLAMA_1B),
        vocab_size=VOCAB,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(SEED)
    with torch.device(args.device):
        model = LlamaForCausalLM(config)  # transformers' own init, seeded
    model.to(torch_dtype(args)).save_pretrained(args.model_dir)
    copy_tokenizer(args.tokenizer_dir, args.model_dir)
    return sum(p.numel() for p in model.parameters())


def copy_tokenizer(src: Path, dst: Path) -> None:
    if not Path(src, "tokenizer.json").exists():
        raise SystemExit(f"no tokenizer.json in --tokenizer-dir {src}")
    for name in TOKENIZER_FILES:
        if Path(src, name).exists():
            shutil.copy(Path(src, name), Path(dst, name))
    # The class every transformers release with fast tokenizers reads from tokenizer.json
    # (SmolLM2's config names TokenizersBackend, which older 5.x releases may not know).
    cfg_path = Path(dst, "tokenizer_config.json")
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    write_json(cfg_path, cfg)


def worker_offline(args: argparse.Namespace, report: Report) -> None:
    llm, startup = make_llm(args)
    eager = engine_kwargs(args).get("enforce_eager", False)
    report.update(startup_s=startup, enforce_eager=eager, runs=[])
    runs = []
    for run in range(3):
        with CompileCounter() as built:
            runs.append(timed_generate(llm, make_workload(args.tiny, run)))
        runs[-1]["kernel_variants_built"] = built.names
        runs[-1]["reserved_gib"] = reserved_gib(llm)  # the allocator's growth, run by run
        report.update(runs=runs)


def worker_batch1(args: argparse.Namespace, report: Report) -> None:
    llm, startup = make_llm(args)
    report.update(startup_s=startup, runs=[])
    prompt_len, output_len = (16, 32) if args.tiny else (BATCH1_PROMPT, BATCH1_OUTPUT)
    runs = []
    for run in range(2):  # cold, then warm (another prompt: no prefix-cache hit)
        rng = random.Random(SEED + 1 + run)
        request = Request([rng.randrange(VOCAB) for _ in range(prompt_len)], output_len)
        t = time.perf_counter()
        with CompileCounter() as built:
            out = llm.generate([request.prompt], sampling_params(output_len), use_tqdm=False)[0]
        wall = time.perf_counter() - t
        m = out.metrics
        runs.append({
            "ms_per_token": wall / output_len * 1e3,
            "decode_ms_per_token": (m.finished_time - m.first_token_time) / (output_len - 1) * 1e3,
            "ttft_ms": m.time_to_first_token * 1e3,
            "kernel_variants_built": built.names,
        })
        report.update(runs=runs)


class CompileCounter:
    """The Triton kernel variants built while it is active (Triton's ``jit_cache_hook``; none
    should be: the warm-up compiles every variant a step meets)."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def __enter__(self) -> CompileCounter:
        knobs = _triton_runtime_knobs()
        if knobs is not None:
            knobs.jit_cache_hook = self._record
        return self

    def __exit__(self, *exc: object) -> None:
        knobs = _triton_runtime_knobs()
        if knobs is not None:
            knobs.jit_cache_hook = None

    def _record(self, *, fn: Any, **_kwargs: Any) -> None:
        self.names.append(fn.name)


def _triton_runtime_knobs() -> Any:
    try:
        import triton
    except ImportError:
        return None
    return getattr(getattr(triton, "knobs", None), "runtime", None)


def make_llm(args: argparse.Namespace) -> tuple[Any, float]:
    from services.engine import LLM

    start = time.perf_counter()
    llm = LLM(str(args.model_dir), **engine_kwargs(args))
    return llm, time.perf_counter() - start


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {**ENGINE_ARGS, "device": args.device, "dtype": dtype_name(args)}
    if args.enforce_eager and has_enforce_eager():
        kw["enforce_eager"] = True
    return kw


def has_enforce_eager() -> bool:
    from services.engine.config import EngineConfig

    return "enforce_eager" in {f.name for f in dataclasses.fields(EngineConfig)}


def timed_generate(llm: Any, work: list[Request]) -> dict[str, float]:
    sync(llm_device(llm))
    t = time.perf_counter()
    outs = llm.generate(
        [r.prompt for r in work], [sampling_params(r.output_len) for r in work], use_tqdm=False
    )
    dt = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": dt, "output_tokens": tokens, "tok_s": tokens / dt}


def reserved_gib(llm: Any) -> float | None:
    import torch

    device = llm.engine.runner.device
    return torch.cuda.memory_reserved(device) / 2**30 if device.type == "cuda" else None


def llm_device(llm: Any) -> str:
    return str(llm.engine.runner.device)


def worker_hf_static(args: argparse.Namespace, report: Report) -> None:
    import torch

    hf = load_hf(args)
    work = make_workload(args.tiny)
    hf_generate(hf, work[:2], 2, args.device)  # warm-up: CUDA context, kernels
    sync(args.device)
    tokens, start = 0, time.perf_counter()
    for i in range(0, len(work), args.hf_batch_size):
        tokens += hf_generate(hf, work[i : i + args.hf_batch_size], None, args.device)
        sync(args.device)
        dt = time.perf_counter() - start
        report.update(batches_done=i // args.hf_batch_size + 1, seconds=dt,
                      output_tokens=tokens, tok_s=tokens / dt, batch_size=args.hf_batch_size,
                      attn=hf.config._attn_implementation, torch=torch.__version__)


def hf_generate(hf: Any, chunk: list[Request], new_tokens: int | None, device: str) -> int:
    """One left-padded static batch run to its longest output; returns the tokens requested."""
    import torch

    width = max(len(r.prompt) for r in chunk)
    ids = torch.zeros((len(chunk), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, r in enumerate(chunk):
        ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
        mask[row, width - len(r.prompt) :] = 1
    longest = new_tokens or max(r.output_len for r in chunk)
    with torch.inference_mode():
        hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                    max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                    pad_token_id=0)
    return sum(min(r.output_len, longest) for r in chunk)


def worker_hf_batch(args: argparse.Namespace, report: Report) -> None:
    """``generate_batch`` as this transformers release spells it (keywords read from its
    signature; positional if those are refused); a failure is recorded in the report."""
    import inspect

    from transformers import GenerationConfig

    hf = load_hf(args)
    work = make_workload(args.tiny)
    fn = getattr(hf, "generate_batch", None)
    if fn is None:
        report.update(error="this transformers has no generate_batch")
        return
    longest = max(r.output_len for r in work)
    accepted = inspect.signature(fn).parameters
    kwargs: dict[str, Any] = {
        "generation_config": GenerationConfig(max_new_tokens=longest, do_sample=False)
    }
    if "progress_bar" in accepted:
        kwargs["progress_bar"] = False
    if args.tiny and "warmup" in accepted:
        kwargs["warmup"] = False  # CUDA-graph capture: nothing to warm on a CPU
    report.update(max_new_tokens=longest, call_kwargs=sorted(kwargs))
    prompts = [r.prompt for r in work]
    sync(args.device)
    start = time.perf_counter()
    try:
        outputs = fn(inputs=prompts, **kwargs)
    except TypeError as exc:  # another release's signature: the two arguments every one has
        report.update(keyword_call_failed=f"{exc}"[:300])
        outputs = fn(prompts, kwargs["generation_config"])
    sync(args.device)
    dt = time.perf_counter() - start
    tokens = sum(len(generated_tokens(o)) for o in outputs.values())
    report.update(seconds=dt, output_tokens=tokens, tok_s=tokens / dt, requests=len(outputs),
                  timed="the whole generate_batch call: its set-up and warm-up included")


def generated_tokens(output: Any) -> list[int]:
    for name in ("generated_tokens", "output_ids", "sequences"):
        value = getattr(output, name, None)
        if value is not None:
            return list(value)
    raise TypeError(f"no generated tokens on {type(output).__name__}")


def load_hf(args: argparse.Namespace) -> Any:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(args.model_dir), dtype=torch_dtype(args), attn_implementation="sdpa"
    )
    return hf.to(args.device).eval()


WORKERS: dict[str, Callable[[argparse.Namespace, Report], None]] = {
    "model": worker_model,
    "offline": worker_offline,
    "offline_eager": worker_offline,
    "batch1": worker_batch1,
    "hf_static": worker_hf_static,
    "hf_batch": worker_hf_batch,
}


def torch_dtype(args: argparse.Namespace) -> Any:
    import torch

    return torch.float32 if args.device == "cpu" else torch.bfloat16


def dtype_name(args: argparse.Namespace) -> str:
    return "float32" if args.device == "cpu" else "bfloat16"


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def module_version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except ImportError:
        return None


# ------------------------------------------------------------------------- the server part


def part_server(args: argparse.Namespace, ctx: Context, cap_s: float,
                core: str = "inline") -> dict[str, Any]:
    """Starts the engine server in a fresh process (its engine core on a thread of it, or in
    a process of its own), streams the workload through it twice."""
    deadline = time.monotonic() + cap_s
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = ctx.tmp / "server.log"
    cmd = [sys.executable, "-m", "services.engine.serving.server", "--host", "127.0.0.1",
           "--port", str(port), "--model", str(ctx.model_dir), "--device", args.device,
           "--dtype", dtype_name(args), "--log-level", "WARNING", "--engine-core", core,
           *server_flags(args)]
    result: dict[str, Any] = {"engine_core": core, "runs": []}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=ctx.server_env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            start = time.monotonic()
            wait_healthy(url, proc, deadline)
            result["startup_s"] = time.monotonic() - start
            for run in range(2):
                left = deadline - time.monotonic()
                work = make_workload(args.tiny, run)
                server_cpu, client_cpu = cpu_seconds(proc.pid), time.process_time()
                result["runs"].append(asyncio.run(stream_workload(url, work, left)))
                # Which side was busy: a side near 1 CPU-second per second limits the run.
                result["runs"][-1]["client_cpu_s"] = time.process_time() - client_cpu
                if server_cpu is not None:
                    result["runs"][-1]["server_cpu_s"] = cpu_seconds(proc.pid) - server_cpu
                ctx.save_partial(SERVER_PARTS[core], result)
        except Exception as exc:  # noqa: BLE001 -- recorded with the server's log tail
            result["error"] = f"{type(exc).__name__}: {exc}"
            result["server_log_tail"] = log_path.read_text(errors="replace")[-3000:]
        finally:
            stop_process(proc)
    return result


def cpu_seconds(pid: int) -> float | None:
    """CPU time of the process ``pid`` and its children (psutil; None without it)."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
        return sum(sum(p.cpu_times()[:2]) for p in procs)
    except psutil.Error:
        return None


def server_flags(args: argparse.Namespace) -> list[str]:
    flags = []
    for name, value in ENGINE_ARGS.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    if args.enforce_eager and has_enforce_eager():
        flags += ["--enforce-eager", "true"]
    return flags


def wait_healthy(url: str, proc: subprocess.Popen, deadline: float) -> None:
    health = url + "/health"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(health, timeout=2) as resp:
            if resp.status == 200:
                return
        time.sleep(0.25)
    raise TimeoutError("the server did not report ready in time")


async def stream_workload(url: str, work: list[Request], timeout_s: float) -> dict[str, Any]:
    """Every request at once, each a streaming ``/internal/generate``; the wall time runs from
    the first request sent to the last stream's end."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)  # aiohttp's default caps at 100 connections
    timeout = aiohttp.ClientTimeout(total=max(timeout_s, 1.0))
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(one_stream(session, url, i, r) for i, r in enumerate(work)), return_exceptions=True
        )
        dt = time.perf_counter() - start
    tokens = sum(r for r in results if isinstance(r, int))
    failures = [f"{type(r).__name__}: {r}"[:300] for r in results if not isinstance(r, int)]
    return {"seconds": dt, "output_tokens": tokens, "tok_s": tokens / dt,
            "failures": len(failures), "first_failures": failures[:3]}


async def one_stream(session: Any, url: str, index: int, request: Request) -> int:
    from services.protocol import engine_api as api

    body = api.GenerateRequest(f"bench-{index}", request.prompt,
                               sampling_params(request.output_len)).to_msgpack()
    headers = {"Content-Type": api.CONTENT_TYPE, **internal_headers()}
    tokens, last = 0, None
    async with session.post(url + api.GENERATE_PATH, data=body, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        decoder = api.FrameDecoder()
        async for chunk in resp.content.iter_any():
            for frame in decoder.feed(chunk):
                if isinstance(frame, api.TokensFrame):
                    tokens += len(frame.token_ids)
                else:
                    last = frame  # finished or error: the stream's last frame
    if not isinstance(last, api.FinishedFrame) or tokens != request.output_len:
        raise RuntimeError(f"{tokens} of {request.output_len} tokens, then {last}")
    return tokens


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# The engine server imports OpenTelemetry's API for tracing, which stays off without OTEL_*
# variables. Where the package is missing (the GPU machine has no registry to install it
# from), these no-op modules stand in for the names it uses, on the server's path only.
OTEL_STUB = {
    "__init__.py": "",
    "context.py": "Context = dict\n",
    "propagate.py": "def inject(carrier, context=None):\n    return None\n\n\n"
                    "def extract(carrier):\n    return {}\n",
    "trace.py": '''import enum


class SpanKind(enum.Enum):
    INTERNAL = 0
    SERVER = 1
    CLIENT = 2


class StatusCode(enum.Enum):
    UNSET = 0
    OK = 1
    ERROR = 2


class Span:
    def is_recording(self):
        return False

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


class Tracer:
    pass


class NoOpTracer(Tracer):
    pass


class ProxyTracerProvider:
    pass


_PROVIDER = ProxyTracerProvider()


def get_tracer_provider():
    return _PROVIDER


def get_current_span(context=None):
    return Span()
''',
}


def otel_stub(tmp: Path) -> Path | None:
    """A directory to put first on the server's path, or None when the real API is there."""
    import importlib.util

    if importlib.util.find_spec("opentelemetry") is not None:
        return None
    root = tmp / "otel-stub"
    for name, text in OTEL_STUB.items():
        Path(root, "opentelemetry").mkdir(parents=True, exist_ok=True)
        Path(root, "opentelemetry", name).write_text(text)
    return root


# --------------------------------------------------------------------------- kernel part


def part_kernel(args: argparse.Namespace, ctx: Context, cap_s: float) -> dict[str, Any]:
    bench = REPO / "benchmarks" / "decode_attention_bench.py"
    if not bench.exists():
        return {"skipped": "benchmarks/decode_attention_bench.py does not exist"}
    out = ctx.tmp / "decode.json"
    cmd = [sys.executable, str(bench), "--quick", "--json", str(out)]
    if args.device == "cpu":
        cmd.append("--smoke")
    done = subprocess.run(cmd, cwd=REPO, env=ctx.env, capture_output=True, text=True,
                          timeout=cap_s, check=False)
    if done.returncode != 0 or not out.exists():
        return {"error": f"exit {done.returncode}", "stderr_tail": done.stderr[-2000:]}
    rows = json.loads(out.read_text()).get("decode", [])
    row = next((r for r in rows if r.get("shape") == "128x1024"), rows[0] if rows else None)
    if row is None:
        return {"error": "no decode rows in its JSON"}
    keep = ("shape", "default_us", "default_tbps", "sdpa_us", "sdpa_tbps")
    return {k: row.get(k) for k in keep}


# ----------------------------------------------------------------------------- orchestration


@dataclasses.dataclass
class Context:
    model_dir: Path
    tmp: Path
    env: dict[str, str]
    server_env: dict[str, str]
    results: dict[str, Any]
    json_path: Path | None
    deadline: float

    def save_partial(self, part: str, value: dict[str, Any]) -> None:
        self.results["parts"][part] = value
        if self.json_path is not None:
            write_json(self.json_path, self.results)


def run_worker(part: str, args: argparse.Namespace, ctx: Context, cap_s: float) -> dict:
    out = ctx.tmp / f"{part}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", part,
           "--model-dir", str(ctx.model_dir), "--out", str(out), "--device", args.device,
           "--tokenizer-dir", str(args.tokenizer_dir), "--hf-batch-size", str(args.hf_batch_size)]
    if args.tiny:
        cmd.append("--tiny")
    if args.enforce_eager != (part == "offline_eager"):  # the comparison flips the flag
        cmd.append("--enforce-eager")
    proc = subprocess.Popen(cmd, cwd=REPO, env=ctx.env, start_new_session=True)
    error = None
    try:
        proc.wait(cap_s)
        if proc.returncode != 0:
            error = f"worker exited with {proc.returncode}"
    except subprocess.TimeoutExpired:
        stop_process(proc, grace_s=5.0)
        error = f"timed out after {cap_s:.0f}s (what it measured before is kept)"
    result = json.loads(out.read_text()) if out.exists() else {}
    if error:
        result["error"] = f"{result['error']} ({error})" if "error" in result else error
    return result


def run_part(part: str, args: argparse.Namespace, ctx: Context) -> None:
    left = ctx.deadline - time.monotonic()
    cap = min(CAPS_S[part] * (0.5 if args.tiny else 1.0), left)
    if cap < MIN_PART_S:
        ctx.save_partial(part, {"skipped": f"{left:.0f}s of --budget-s left"})
        return
    print(f"== {part} (cap {cap:.0f}s)", flush=True)
    start = time.monotonic()
    if part in ("server", "server_process"):
        result = part_server(args, ctx, cap, "process" if part == "server_process" else "inline")
    elif part == "kernel":
        result = part_kernel(args, ctx, cap)
    else:
        result = run_worker(part, args, ctx, cap)
    result["wall_s"] = time.monotonic() - start
    ctx.save_partial(part, result)
    print(f"   {summarise_part(part, result)}", flush=True)


def internal_headers() -> dict[str, str]:
    """The internal credential the server started here requires (``make_context`` makes it)."""
    from services.common.internal_auth import ensure_tokens

    return ensure_tokens(os.environ).headers()


def make_context(args: argparse.Namespace, tmp: Path) -> Context:
    internal_headers()  # a token in our environment, inherited by the server
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    caches = args.kernel_cache or tmp / "kernel-cache"
    env["TRITON_CACHE_DIR"] = str(caches / "triton")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(caches / "inductor")
    if args.device != "cpu":
        env["PAGODA_CPU_OPS"] = "0"  # never build the CPU kernels on a GPU machine
    stub = otel_stub(tmp)
    server_env = dict(env)
    if stub is not None:
        server_env["PYTHONPATH"] = os.pathsep.join((str(stub), env["PYTHONPATH"]))
    model_dir = Path(args.model_dir) if args.model_dir else tmp / "model"
    work = make_workload(args.tiny)
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "argv": sys.argv[1:],
        "workload": workload_summary(work),
        "engine_args": ENGINE_ARGS,
        "kernel_cache": str(caches),
        "otel_stub_for_server": stub is not None,
        "parts": {},
    }
    return Context(model_dir, tmp, env, server_env, results, args.json,
                   time.monotonic() + args.budget_s)


def workload_summary(work: list[Request]) -> dict[str, Any]:
    prompt = sum(len(r.prompt) for r in work)
    output = sum(r.output_len for r in work)
    ceiling_s = (prompt + output) * FLOP_PER_TOKEN / PEAK_FLOPS
    return {"requests": len(work), "prompt_tokens": prompt, "output_tokens": output,
            "ceiling_tok_s": output / ceiling_s}


def orchestrate(args: argparse.Namespace) -> dict[str, Any]:
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown parts: {sorted(unknown)}; known: {', '.join(PARTS)}")
    if args.compare_eager and "offline" in parts:
        parts.insert(parts.index("offline") + 1, "offline_eager")
    with tempfile.TemporaryDirectory(prefix="pagoda-gpu-bench-") as d:
        ctx = make_context(args, Path(d))
        ctx.model_dir.mkdir(parents=True, exist_ok=True)
        run_part("model", args, ctx)
        for part in parts:
            run_part(part, args, ctx)
        ctx.results["summary"] = summarise(ctx.results)
        if ctx.json_path is not None:
            write_json(ctx.json_path, ctx.results)
        return ctx.results


# ---------------------------------------------------------------------------------- report


def best_warm(runs: list[dict]) -> float | None:
    warm = [r["tok_s"] for r in runs[1:] if "tok_s" in r]
    return max(warm) if warm else None


def summarise(results: dict[str, Any]) -> dict[str, Any]:
    parts, work = results["parts"], results["workload"]
    offline_runs = parts.get("offline", {}).get("runs", [])
    warm = best_warm(offline_runs)
    s: dict[str, Any] = {"offline_warm_tok_s": warm}
    if offline_runs:
        s["offline_cold_tok_s"] = offline_runs[0]["tok_s"]
        if warm:
            s["cold_over_warm"] = offline_runs[0]["tok_s"] / warm
    if warm:
        s["share_of_ceiling"] = warm / work["ceiling_tok_s"]
        for peer in ("hf_static", "hf_batch"):
            if parts.get(peer, {}).get("tok_s"):
                s[f"offline_over_{peer}"] = warm / parts[peer]["tok_s"]
        for part in SERVER_PARTS.values():
            if parts.get(part, {}).get("runs"):
                s[f"{part}_over_offline"] = [r["tok_s"] / warm for r in parts[part]["runs"]]
    for name in ("model", "offline_eager", "batch1", "kernel"):
        if name in parts:
            s[name] = summarise_part(name, parts[name])
    return s


def summarise_part(part: str, r: dict[str, Any]) -> str:
    if "skipped" in r:
        return f"skipped: {r['skipped']}"
    text = ""
    if "runs" in r and part == "batch1":
        text = ", ".join(f"{x['ms_per_token']:.2f} ms/token (decode {x['decode_ms_per_token']:.2f})"
                         for x in r["runs"])
    elif "runs" in r:
        text = ", ".join(f"{x['tok_s']:,.0f} tok/s" + (f" ({x['failures']} failed)"
                         if "failures" in x else "") for x in r["runs"])
    elif "tok_s" in r:
        text = f"{r['tok_s']:,.0f} tok/s ({r['output_tokens']:,} tokens in {r['seconds']:.1f}s)"
    elif "default_tbps" in r:
        text = (f"{r['shape']}: {r['default_tbps']:.2f} TB/s ({r['default_us']:.1f} µs; "
                f"SDPA contiguous {r['sdpa_tbps']:.2f} TB/s)")
    elif "device" in r:
        made = "reused" if r["reused"] else f"{r['params'] / 1e6:,.1f}M params, {r['seconds']:.0f}s"
        text = (f"{r['device']}, torch {r['torch']}, triton {r['triton']}, transformers "
                f"{r['transformers']}; model {made}")
    if "startup_s" in r:
        text += f"; startup {r['startup_s']:.1f}s"
    if "error" in r:
        text += f"; ERROR {r['error']}"
    return text.strip("; ")


def print_report(results: dict[str, Any]) -> None:
    w, s = results["workload"], results["summary"]
    print(f"\n# Pagoda GPU throughput, {results['date']}")
    print(f"workload: {w['requests']} requests, {w['prompt_tokens']:,} prompt + "
          f"{w['output_tokens']:,} output tokens; compute ceiling {w['ceiling_tok_s']:,.0f} "
          "output tok/s")
    for part, r in results["parts"].items():
        print(f"  {part:14} {summarise_part(part, r)}")
    for key, value in s.items():
        if isinstance(value, float):
            print(f"  {key:28} {value:,.3f}")
        elif isinstance(value, list):
            print(f"  {key:28} {', '.join(f'{v:.3f}' for v in value)}")


def write_json(path: Path, data: Any) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    ap.add_argument("--json", type=Path, default=None, help="results, rewritten after each part")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="2-layer model, 16 short requests")
    ap.add_argument("--tokenizer-dir", type=Path, default=REPO / ".gpu_assets/smollm2-tokenizer")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="reuse (or make and keep) the model here; default: a temporary one")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall time for all parts (default 285, 110 with --tiny)")
    ap.add_argument("--kernel-cache", type=Path, default=None,
                    help="Triton's and Inductor's caches go here (default: empty ones, so the "
                    "first offline run is cold; later parts reuse what it compiled)")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="no CUDA graphs (passed only where EngineConfig has enforce_eager)")
    ap.add_argument("--compare-eager", action="store_true",
                    help="run offline again with the opposite --enforce-eager")
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = 110.0 if args.tiny else 285.0
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        report = Report(args.out)
        try:
            WORKERS[args.worker](args, report)
        except Exception as exc:
            report.update(error=f"{type(exc).__name__}: {exc}"[:2000])
            raise
        return
    results = orchestrate(args)
    print_report(results)


if __name__ == "__main__":
    main()
