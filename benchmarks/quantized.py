"""Quantized checkpoints of the default model (issue 38): perplexity and decode speed, one run.

    .venv/bin/python benchmarks/quantized.py                 # 20,480 tokens: ~15 min on 2 cores
    .venv/bin/python benchmarks/quantized.py --tokens 2048   # a quick look

Checkpoints made from SmolLM2-135M into ``--dir`` (reused when present): compressed-tensors W8A8
int8 and FP8 W8A16 (written by compressed-tensors), GPTQ 4-bit (packed as AutoGPTQ's loader reads
it; group ``--group``: 128 does not divide the model's 576-wide hidden size, 64 does). For each
and for the unquantized model in float32 and bfloat16: perplexity on English text from the
Python documentation (``pydoc_data.topics``), in independent windows of ``--window`` tokens,
and the median and best decode step at batch 1 and 8 (48 new tokens each). Not a timed test:
figures depend on the machine, named in the first line.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.engine_throughput import machine_line  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.engine import LLMEngine  # noqa: E402
from services.engine.models.default import default_model_path  # noqa: E402
from services.engine.models.loader import load_model  # noqa: E402
from services.protocol.sampling_params import SamplingParams  # noqa: E402
from tests.engine.test_models import _step  # noqa: E402
from tests.support.quantized import write_fp8_w8a16, write_int4, write_w8a8  # noqa: E402


def english(path: Path, n: int) -> list[int]:
    from pydoc_data.topics import topics

    from transformers import AutoTokenizer

    text = "\n".join(topics[k] for k in sorted(topics))
    ids = AutoTokenizer.from_pretrained(path)(text)["input_ids"]
    if len(ids) < n:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than --tokens {n}")
    return ids[:n]


def perplexity(path: Path, dtype: torch.dtype, ids: list[int], window: int) -> float:
    model = load_model(path, dtype=dtype)
    model.pack_weights()
    cfg = model.config
    blocks = -(-window // 16)
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        if len(chunk) < 2:
            break
        kv = [(torch.zeros(blocks, 16, cfg.num_kv_heads, cfg.head_dim, dtype=dtype),
               torch.zeros(blocks, 16, cfg.num_kv_heads, cfg.head_dim, dtype=dtype))
              for _ in range(cfg.num_layers)]
        (logits,) = _step(model, kv, [chunk], [0], [len(chunk)], [list(range(blocks))])
        nll = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(chunk[1:]),
                                                reduction="sum")
        total, count = total + nll.item(), count + len(chunk) - 1
    return math.exp(total / count)


def decode_steps(path: Path, dtype: str) -> str:
    engine = LLMEngine(EngineConfig(model=str(path), dtype=dtype, num_blocks=256))
    parts = []
    for batch in (1, 8):
        params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"{batch}-{i}", list(range(100 + i, 132 + i)), params)
        times = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        steady = times[2:]
        parts.append(f"batch {batch}: median {statistics.median(steady) * 1e3:.1f} ms, "
                     f"best {min(steady) * 1e3:.1f} ms")
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20480)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/pagoda-quantized"))
    parser.add_argument("--no-speed", action="store_true")
    args = parser.parse_args()
    base = default_model_path()
    made = {
        "w8a8-int8": lambda out: write_w8a8(base, out),
        "fp8-w8a16": lambda out: write_fp8_w8a16(base, out),
        f"gptq-4bit-g{args.group}": lambda out: write_int4(base, out, "gptq", args.group)[0],
    }
    runs = [("float32", base, "float32"), ("bfloat16", base, "bfloat16")]
    for name, write in made.items():
        out = args.dir / name
        if not (out / "config.json").exists():
            write(out)
        runs.append((name, out, "float32"))
    print(machine_line(), flush=True)
    ids = english(base, args.tokens)
    for name, path, dtype in runs:
        ppl = perplexity(path, getattr(torch, dtype), ids, args.window)
        speed = "" if args.no_speed else " | " + decode_steps(path, dtype)
        print(f"RESULT {name}: perplexity {ppl:.3f} over {len(ids)} tokens{speed}", flush=True)


if __name__ == "__main__":
    main()
