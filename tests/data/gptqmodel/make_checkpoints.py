"""Makes the GPTQ checkpoints in this directory with GPTQModel itself (issue 38: checkpoints
written by the tool that defines the format, where it runs on this CPU). Run once, by hand:

    GPTQMODEL_CPU_WORKERS=2 /work/gptq-venv/bin/python tests/data/gptqmodel/make_checkpoints.py

``/work/gptq-venv``: a virtualenv of its own with ``gptqmodel==7.7.0`` (it pins torch 2.14.1 and
transformers 5.24, not the project's); it ran on a 2-core AMD EPYC without a GPU on 2026-12-03.
The model: a random 2-layer Llama (the tests' tiny dimensions, 128 wide so that every input
holds whole groups), seed 11, quantized on 16 random sequences of 64 tokens: ``g64`` (group 64,
symmetric, no act-order) and ``g32-act-order`` (group 32, ``desc_act``: a scattered ``g_idx``).
Only the files the engine reads are kept (config, weights).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

import torch  # noqa: E402

from tests.conftest import TINY_DIMS, _write_tiny_model  # noqa: E402

WIDE = {"hidden_size": 128, "intermediate_size": 256}
CASES = {"g64": (64, False), "g32-act-order": (32, True)}
KEEP = ("config.json", "model.safetensors", "quantize_config.json")


def main() -> None:
    from gptqmodel import GPTQModel, QuantizeConfig

    from services.engine.models.default import default_model_path

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        _write_tiny_model(base, "LlamaForCausalLM", 11, WIDE)
        for name in ("tokenizer.json", "tokenizer_config.json"):  # GPTQModel loads one
            shutil.copy(default_model_path() / name, base / name)
        g = torch.Generator().manual_seed(5)
        rows = torch.randint(0, TINY_DIMS["vocab_size"], (16, 64), generator=g).tolist()
        data = [{"input_ids": r, "attention_mask": [1] * len(r)} for r in rows]
        for case, (group, act_order) in CASES.items():
            config = QuantizeConfig(bits=4, group_size=group, sym=True, desc_act=act_order)
            model = GPTQModel.load(str(base), config, device="cpu", dtype=torch.float32)
            model.quantize(data, batch_size=4)
            made = Path(tmp) / case
            model.save(str(made))
            out = HERE / case
            out.mkdir(exist_ok=True)
            for name in KEEP:
                shutil.copy(made / name, out / name)
            print(case, sorted(p.name for p in out.iterdir()), flush=True)


if __name__ == "__main__":
    main()
