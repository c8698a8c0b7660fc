"""Quantized checkpoints for tests, written by the library that defines the format, and the
plain-torch reference that applies the same quantization math on transformers' model.

``write_w8a8`` quantizes an HF checkpoint with compressed-tensors exactly as llm-compressor's
W8A8 recipe does for the weights (its min-max observer per output channel, then
``ModelCompressor`` to the ``int-quantized`` format), with ``lm_head`` left unquantized;
``write_fp8_w8a16`` the same with FP8 weights per channel and activations left alone.
llm-compressor itself would pin another transformers than the project's, so it is not used.

``w8a8_reference`` is transformers' model with every quantized ``nn.Linear`` running on the
checkpoint's int8 weights times their scales, its input rounded per token to int8
(``scale = max|x| / 127``), all in float32.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

_NOT_WEIGHTS = ("*.safetensors", "model.safetensors.index.json", "config.json")


def write_w8a8(src: Path, out: Path, ignore: tuple[str, ...] = ("lm_head",)) -> Path:
    from compressed_tensors.quantization.quant_scheme import INT8_W8A8

    return _write(src, out, INT8_W8A8, ignore)


def write_fp8_w8a16(src: Path, out: Path) -> Path:
    """FP8 weights per output channel, activations left alone (``float-quantized``)."""
    from compressed_tensors.quantization import QuantizationArgs

    weights = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True,
                               dynamic=False)
    return _write(src, out, {"weights": weights}, ("lm_head",))


def _write(src: Path, out: Path, args: dict, ignore: tuple[str, ...]) -> Path:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    scheme = QuantizationScheme(targets=["Linear"], **args)
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore)))
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):  # min-max per output channel, as the observer
                w = module.weight
                scale, _ = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True),
                                             module.quantization_scheme.weights)
                module.weight_scale.copy_(scale)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for extra in src.iterdir():  # tokenizer, generation config
        if extra.is_file() and not any(extra.match(p) for p in _NOT_WEIGHTS):
            shutil.copy(extra, out / extra.name)
    return out


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def _fake_quant(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.round(x / scale).clamp(-128, 127) * scale


def _quantize_input(_module: torch.nn.Module, args: tuple) -> tuple:
    return (_fake_quant(args[0].float()),)


# Row-parallel projections: under tensor parallelism each rank holds a block of their input.
_ROW_PARALLEL = ("o_proj", "down_proj")


def _per_rank(ranks: int):
    def hook(_module: torch.nn.Module, args: tuple) -> tuple:
        parts = args[0].float().chunk(ranks, dim=-1)
        return (torch.cat([_fake_quant(p) for p in parts], dim=-1),)
    return hook


def fp8_reference(original: Path, quantized: Path) -> torch.nn.Module:
    """transformers' float32 model of ``original`` with ``quantized``'s FP8 weights times their
    scales."""
    model = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32).eval()
    stored = _checkpoint(quantized)
    with torch.no_grad():
        for name, module in model.named_modules():
            if f"{name}.weight_scale" in stored:
                module.weight.copy_(stored[f"{name}.weight"].float()
                                    * stored[f"{name}.weight_scale"].float())
    return model


def w8a8_reference(original: Path, quantized: Path, ranks: int = 1) -> torch.nn.Module:
    """transformers' float32 model of ``original`` running ``quantized``'s W8A8 math; with
    ``ranks``, a row-parallel projection's input is quantized per token in ``ranks`` blocks of
    columns, each with its own scale, as that many tensor-parallel ranks do."""
    model = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32).eval()
    stored = _checkpoint(quantized)
    with torch.no_grad():
        for name, module in model.named_modules():
            scale = stored.get(f"{name}.weight_scale")
            if isinstance(module, torch.nn.Linear) and scale is not None:
                module.weight.copy_(stored[f"{name}.weight"].float() * scale.float())
                row_parallel = ranks > 1 and name.endswith(_ROW_PARALLEL)
                module.register_forward_pre_hook(_per_rank(ranks) if row_parallel
                                                 else _quantize_input)
    return model
