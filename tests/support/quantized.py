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


# --------------------------------------------------------------------------- GPTQ and AWQ
# Packed by hand, exactly as the AutoGPTQ/GPTQModel (v1 format) and AutoAWQ (gemm) loaders read
# them (neither tool runs on this CPU). Weights are rounded to nearest per group (the GPTQ
# algorithm's error feedback changes the values, not the format).

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _rtn(w: torch.Tensor, group_size: int, perm: torch.Tensor | None, sym: bool = False):
    """(q [in, out], zeros [G, out], scales fp16 [G, out], g_idx [in]) of ``w`` [out, in];
    ``sym``: GPTQ's symmetric grid (zero point 8, scale 2 max|w| / 15), which vLLM's GPTQ
    kernels take."""
    out, inp = w.shape
    g = inp if group_size == -1 else group_size
    order = torch.arange(inp) if perm is None else perm
    g_idx = torch.empty(inp, dtype=torch.int32)
    g_idx[order] = (torch.arange(inp) // g).to(torch.int32)
    wt = w.t().float()
    scales = torch.empty(inp // g, out, dtype=torch.float16)
    zeros = torch.empty(inp // g, out, dtype=torch.int64)
    for group in range(inp // g):
        block = wt[g_idx == group]
        lo, hi = block.amin(0).clamp(max=0), block.amax(0).clamp(min=0)
        if sym:
            hi = torch.maximum(hi, -lo)
            lo = -hi
        scales[group] = ((hi - lo) / 15).clamp(min=1e-6).half()
        zeros[group] = (torch.full_like(zeros[group], 8) if sym else
                        torch.round(-lo / scales[group].float()).clamp(1, 15).long())
    s, z = scales.float()[g_idx.long()], zeros[g_idx.long()]
    q = (torch.round(wt / s) + z).clamp(0, 15).long()
    return q, zeros, scales, g_idx


def _pack(values: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))):
    """Eight 4-bit values per int32 along ``dim``: nibble k holds element ``order[k]``."""
    v = values.long().movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)
    packed = sum((v[..., order[k]] & 0xF) << (4 * k) for k in range(8))
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.movedim(-1, dim).contiguous()


def write_int4(src: Path, out: Path, fmt: str, group_size: int, act_order: bool = False,
               sym: bool = False):
    """Writes ``src`` as a 4-bit ``fmt`` ("gptq" or "awq"; ``sym``: GPTQ's symmetric grid)
    checkpoint in ``out``; returns
    (out, {linear name: its dequantized float32 weight}) for ``int4_reference``."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    dense: dict[str, torch.Tensor] = {}
    generator = torch.Generator().manual_seed(0)
    perms: dict[tuple, torch.Tensor] = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name == "lm_head":
            continue
        # Act-order sorts columns by the input's statistics: projections reading one input
        # (q/k/v, gate/up) share the order, so a fused projection has one g_idx.
        parent, _, short = name.rpartition(".")
        key = (parent, short in ("o_proj", "down_proj"))
        if act_order and key not in perms:
            perms[key] = torch.randperm(module.in_features, generator=generator)
        perm = perms.get(key)
        q, zeros, scales, g_idx = _rtn(module.weight.detach(), group_size, perm, sym)
        del state[f"{name}.weight"]
        dense[name] = ((q - zeros[g_idx.long()]) * scales.float()[g_idx.long()]).t()
        state.update(int4_tensors(name, fmt, q, zeros, scales, g_idx))
    save_int4(src, out, state, fmt, group_size, act_order, sym)
    return out, dense


def int4_tensors(name: str, fmt: str, q: torch.Tensor, zeros: torch.Tensor,
                 scales: torch.Tensor, g_idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """One linear layer's tensors in ``fmt`` ("gptq": v1, "awq": gemm) from ``q`` [in, out]
    (0..15), ``zeros`` [G, out] (1..15), ``scales`` fp16 [G, out] and ``g_idx`` int32 [in]."""
    if fmt == "gptq":
        return {f"{name}.qweight": _pack(q, 0),
                f"{name}.qzeros": _pack(zeros - 1, 1),  # v1: the zero point minus one
                f"{name}.scales": scales,
                f"{name}.g_idx": g_idx}
    return {f"{name}.qweight": _pack(q, 1, AWQ_ORDER),
            f"{name}.qzeros": _pack(zeros, 1, AWQ_ORDER),
            f"{name}.scales": scales}


def save_int4(src: Path, out: Path, state: dict[str, torch.Tensor], fmt: str, group_size: int,
              act_order: bool, sym: bool) -> None:
    """Writes ``state`` and ``src``'s config with the 4-bit ``quantization_config`` (and its
    tokenizer files) into ``out``."""
    import json

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order,
         "sym": sym, "checkpoint_format": "gptq"} if fmt == "gptq" else
        {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
         "version": "gemm"})
    (out / "config.json").write_text(json.dumps(config))
    for extra in src.iterdir():  # tokenizer, generation config
        if extra.is_file() and not any(extra.match(p) for p in _NOT_WEIGHTS):
            shutil.copy(extra, out / extra.name)


def int4_reference(original: Path, dense: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' float32 model of ``original`` with each linear weight replaced by its
    4-bit value dequantized in plain torch (before packing)."""
    model = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32).eval()
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, weight in dense.items():
            modules[name].weight.copy_(weight)
    return model
