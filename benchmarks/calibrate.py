"""Calibrated quantized checkpoints of the default model, made by llm-compressor (issue 38).

    /work/quant-venv/bin/python benchmarks/calibrate.py --dir /tmp/pagoda-quantized

Needs ``llmcompressor`` (0.14; it pins another transformers and compressed-tensors than the
project's, so it lives in its own virtualenv, not in the project's). Writes, into ``--dir``:

* ``w8a8-sq-gptq``: llm-compressor's W8A8 recipe, SmoothQuant (strength 0.8) then GPTQ, int8
  per-channel weights and dynamic per-token activations, saved by llm-compressor itself in the
  compressed-tensors ``int-quantized`` format;
* ``gptq-4bit-g64-calibrated``: GPTQ (llm-compressor's, symmetric int4, group 64: 128 does not
  divide the model's 576-wide hidden size), its values repacked in AutoGPTQ/GPTQModel's v1
  format (``tests.support.quantized.int4_tensors``); GPTQModel itself runs here too (see
  ``tests/data/gptqmodel/make_checkpoints.py``; README: 15.062 on the screen). Variants
  (``--only gptq4`` with ``--group``, ``--actorder``, ``--pipeline``, ``--samples``) are
  written as ``gptq-4bit-g{group}[-actweight][-{pipeline}]-calibrated[-s{samples}]``.
  ``--actorder`` is llm-compressor's only act-order left (``weight``: the columns quantized in
  activation order, the groups kept contiguous); GPTQ's ``desc_act`` groups (a scattered
  ``g_idx``) were removed from llm-compressor in 2026-08 and are not tried here.
  ``--rotate`` (gptq4 only) first rotates the model offline (``benchmarks/rotation.py``:
  QuaRot/SpinQuant's R1 on the residual stream, R2 per head on values, random Hadamard
  matrices, the norms folded in), written once as ``rotated-{kind}[-seed{N}]-fp32`` in
  ``--dir``, then quantizes that, into
  ``gptq-4bit-g{group}-rot[-gaussian][-seed{N}]-calibrated[-s{samples}]`` (``--rotate
  gaussian``: random orthogonal matrices instead; ``--seed``): an untied checkpoint (``lm_head``
  of its own, unquantized) that loads with no change at run time. ``--asym``: asymmetric int4
  (``-asym`` in the name), written in AWQ's ``gemm`` format, whose zero points 0..15 GPTQ's v1
  format cannot hold.
* ``awq-4bit-g{group}[-gptq]-calibrated`` (``--only awq4``): llm-compressor's AWQ (its
  activation-aware scales, ``duo_scaling="both"``) then asymmetric int4 rounded to nearest, or
  GPTQ with ``--awq-gptq``; written in AutoAWQ's ``gemm`` format.

Calibration (``PIPELINE``): ``--samples`` windows of ``--length`` tokens of the Python
documentation's topics (``pydoc_data.topics``) taken after token 40,000, disjoint from the 20,480
tokens the perplexity is measured on (``benchmarks/quantized.py``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from services.engine.models.default import default_model_path  # noqa: E402
from tests.support.quantized import int4_tensors, save_int4  # noqa: E402

CALIBRATION_START = 40_000  # the perplexity reads tokens [0, 20480)
GROUP = 64
# One pass of the whole model per sample, every layer's statistics from the unquantized model's
# activations ("basic"), rather than layer by layer on the quantized layers' outputs
# ("sequential", llm-compressor's default): 30x faster here, on a shared 2-core CPU.
PIPELINE = "basic"


def calibration_set(path: Path, samples: int, length: int):
    from pydoc_data.topics import topics

    from datasets import Dataset
    from transformers import AutoTokenizer

    text = "\n".join(topics[k] for k in sorted(topics))
    ids = AutoTokenizer.from_pretrained(path)(text)["input_ids"][CALIBRATION_START:]
    assert len(ids) >= samples * length, (len(ids), samples, length)
    rows = [ids[i * length : (i + 1) * length] for i in range(samples)]
    return Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * length] * samples})


def w8a8(base: Path, out: Path, data, length: int) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.modifiers.smoothquant import SmoothQuantModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    recipe = [
        SmoothQuantModifier(smoothing_strength=0.8),
        GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"]),
    ]
    oneshot(
        model=model,
        dataset=data,
        recipe=recipe,
        max_seq_length=length,
        num_calibration_samples=len(data),
        pipeline=PIPELINE,
    )
    model.save_pretrained(out, save_compressed=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)


def gptq4(
    base: Path,
    out: Path,
    data,
    length: int,
    group: int = GROUP,
    actorder: str | None = None,
    pipeline: str = PIPELINE,
    asym: bool = False,
) -> None:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    weights = QuantizationArgs(
        num_bits=4,
        type="int",
        symmetric=not asym,
        strategy="group",
        group_size=group,
        actorder=actorder,
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    oneshot(
        model=model,
        dataset=data,
        max_seq_length=length,
        num_calibration_samples=len(data),
        pipeline=pipeline,
        recipe=[GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])],
    )
    state = {
        k: v.detach().contiguous()
        for k, v in model.state_dict().items()
        if not k.endswith(("weight_scale", "weight_zero_point", "weight_g_idx"))
    }
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, module in model.named_modules():
        if not hasattr(module, "weight_scale"):
            continue
        state.pop(f"{name}.weight")
        if asym:
            state.update(int4_tensors(name, "awq", *_as_awq(module, group)))
        else:
            state.update(int4_tensors(name, "gptq", *_as_gptq(module, group)))
    # Asymmetric: zero points 0..15, which GPTQ's v1 format (the zero point minus one) cannot
    # hold; AWQ's gemm format holds the same values exactly.
    fmt = "awq" if asym else "gptq"
    save_int4(base, out, state, fmt, group, act_order=False, sym=not asym)


def awq4(
    base: Path,
    out: Path,
    data,
    length: int,
    group: int = GROUP,
    pipeline: str = PIPELINE,
    then_gptq: bool = False,
) -> None:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from transformers import AutoModelForCausalLM

    if not torch.accelerator.is_available():
        # AWQ pins its cached activations for host-to-device copies; with no device the CPU
        # build of torch refuses to pin, and there is nothing to copy to: keep them as they are.
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    weights = QuantizationArgs(
        num_bits=4, type="int", symmetric=False, strategy="group", group_size=group
    )
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
    quantize = (GPTQModifier if then_gptq else QuantizationModifier)(
        config_groups=groups, ignore=["lm_head"]
    )
    oneshot(
        model=model,
        dataset=data,
        max_seq_length=length,
        num_calibration_samples=len(data),
        pipeline=pipeline,
        recipe=[AWQModifier(duo_scaling="both"), quantize],
    )
    state = {
        k: v.detach().contiguous()
        for k, v in model.state_dict().items()
        if not k.endswith(("weight_scale", "weight_zero_point", "weight_g_idx"))
    }
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, module in model.named_modules():
        if not hasattr(module, "weight_scale"):
            continue
        state.pop(f"{name}.weight")
        state.update(int4_tensors(name, "awq", *_as_awq(module, group)))
    save_int4(base, out, state, "awq", group, act_order=False, sym=False)


def _as_awq(module: torch.nn.Module, group: int):
    """(q [in, out] 0..15, zeros [G, out] 0..15, scales fp16 [G, out], g_idx [in]) of a layer
    llm-compressor quantized asymmetrically: its int4 values -8..7 and zero points shifted by 8."""
    w = module.weight.detach().float()
    scale = module.weight_scale.detach().float()  # [out, G]
    zero = module.weight_zero_point.detach().long() + 8  # [out, G]
    out_f, in_f = w.shape
    groups = torch.arange(in_f) // group
    s, z = scale[:, groups], zero[:, groups]
    q = (torch.round(w / s) + z).clamp(0, 15)
    assert ((q - z) * s - w).abs().max().item() <= 1e-4 * w.abs().max().item()
    return (
        q.t().long(),
        zero.t().contiguous(),
        scale.t().half().contiguous(),
        groups.to(torch.int32),
    )


def _as_gptq(module: torch.nn.Module, group: int):
    """(q [in, out] 0..15, zeros [G, out], scales fp16 [G, out], g_idx [in]) of a layer that
    llm-compressor quantized symmetrically (its weight holds the dequantized values)."""
    w = module.weight.detach().float()
    scale = module.weight_scale.detach().float()  # [out, G]
    out_f, in_f = w.shape
    groups = torch.arange(in_f) // group
    s = scale[:, groups]
    q = (torch.round(w / s) + 8).clamp(0, 15)
    assert ((q - 8) * s - w).abs().max().item() <= 1e-4 * w.abs().max().item()
    zeros = torch.full((in_f // group, out_f), 8, dtype=torch.int64)
    return q.t().long(), zeros, scale.t().half().contiguous(), groups.to(torch.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/pagoda-quantized"))
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--only", choices=("w8a8", "gptq4", "awq4"))
    parser.add_argument("--awq-gptq", action="store_true", help="awq4: GPTQ after AWQ")
    parser.add_argument("--group", type=int, default=GROUP, help="gptq4's group size")
    parser.add_argument("--actorder", choices=("weight",), default=None)
    parser.add_argument("--pipeline", choices=("basic", "sequential"), default=PIPELINE)
    parser.add_argument(
        "--rotate",
        nargs="?",
        const="hadamard",
        choices=("hadamard", "gaussian"),
        help="gptq4: rotate the model first (benchmarks/rotation.py), by random Hadamard "
        "matrices or, with 'gaussian', random orthogonal ones",
    )
    parser.add_argument("--seed", type=int, default=0, help="--rotate's random seed")
    parser.add_argument(
        "--asym", action="store_true", help="gptq4: asymmetric int4 (written in AWQ's format)"
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = default_model_path()
    data = calibration_set(base, args.samples, args.length)
    variant = (f"-act{args.actorder}" if args.actorder else "") + (
        "" if args.pipeline == PIPELINE else f"-{args.pipeline}"
    )
    if args.rotate:
        from benchmarks.rotation import save_rotated

        assert args.only == "gptq4", "--rotate is for --only gptq4"
        seed = "" if args.seed == 0 else f"-seed{args.seed}"
        base = save_rotated(
            base, args.dir / f"rotated-{args.rotate}{seed}-fp32", args.seed, args.rotate
        )
        kind = "" if args.rotate == "hadamard" else f"-{args.rotate}"
        variant = f"-rot{kind}{seed}{variant}"
    variant += "-asym" if args.asym else ""
    samples = "" if args.samples == 32 else f"-s{args.samples}"
    gptq_name = f"gptq-4bit-g{args.group}{variant}-calibrated{samples}"
    for name, make in (
        ("w8a8-sq-gptq", w8a8),
        (
            gptq_name,
            lambda *a: gptq4(
                *a,
                group=args.group,
                actorder=args.actorder,
                pipeline=args.pipeline,
                asym=args.asym,
            ),
        ),
        (
            f"awq-4bit-g{args.group}{'-gptq' if args.awq_gptq else ''}"
            f"{variant}-calibrated{samples}",
            lambda *a: awq4(*a, group=args.group, pipeline=args.pipeline, then_gptq=args.awq_gptq),
        ),
    ):
        out = args.dir / name
        # Without --only: the two checkpoints benchmarks/quantized.py reads.
        if not name.startswith(args.only.rstrip("4") if args.only else ("w8a8", "gptq")):
            continue
        if not (out / "config.json").exists():
            make(base, out, data, args.length)
        print(f"made {out}", flush=True)


if __name__ == "__main__":
    main()
