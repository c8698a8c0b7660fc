"""Loads an HF safetensors checkpoint into our model implementations.

The model is built on the meta device (no memory), materialised once on the target device with
``to_empty``, then every checkpoint tensor is copied straight into its (possibly fused) slot:
peak memory is one copy of the weights plus the memory-mapped file. A tensor-parallel rank
reads only its own slice of each sharded tensor (``safe_open(...).get_slice``), never the whole.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from services.engine.attention.base import AttentionBackend
from services.engine.models.config import ModelConfig
from services.engine.models.layer_kernels import select_kernels
from services.engine.models.layers import CausalLM, Linear
from services.engine.models.parallel_layers import ShardRange
from services.engine.models.pipeline_stage import PipelineStage, keep_local, prune
from services.engine.models.registry import get_model_class
from services.engine.quantization import quant_config_for
from services.engine.quantization.base import ParamLayout, QuantConfig

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Checkpoint entries that carry no weights of ours (old Llama exports saved RoPE frequencies).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True, slots=True)
class _Slot:
    """Where one checkpoint tensor goes: rows ``[offset, offset + rows)`` of a parameter."""

    param: str
    offset: int
    rows: int
    shard: ShardRange | None = None  # this rank's slice of the checkpoint tensor; None: all
    dim: int = 0  # the parameter's output dim, along which stacked sources follow each other
    shared: bool = False  # every stacked source holds all of it (GPTQ's g_idx): they must agree


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attn_backend: AttentionBackend | None = None,
    quantization: str | None = None,
    stage: PipelineStage | None = None,
) -> CausalLM:
    """Builds the model for the HF directory ``path`` and loads its safetensors weights.

    ``stage``: a pipeline stage's share only (its layers, and their weights alone are read).

    ``attn_backend`` defaults to the torch (CPU reference) backend. The checkpoint's
    ``quantization_config`` decides how each linear layer holds its weight; ``quantization``
    (the engine's flag) must agree with it (``quantization.quant_config_for``).
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; supported: {SUPPORTED_DTYPES}")
    path = Path(path)
    config = ModelConfig.from_hf_dir(path)
    quant = quant_config_for(config.quantization, quantization, torch.device(device))
    if attn_backend is None:
        attn_backend = _default_backend()
    start = time.perf_counter()
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, attn_backend, dtype)
        if quant is not None:
            _assign_methods(model, quant)
        if stage is not None:
            prune(model, stage)
    model = model.to_empty(device=torch.device(device))
    model.reset_buffers()
    model.use_kernels(select_kernels(device, dtype))  # once: layers never check the device
    num_tensors = load_weights(model, path)
    if stage is not None:
        keep_local(model, stage)
    for module in model.modules():
        if isinstance(module, Linear):
            module.method.process_weights_after_loading(module)
    model.after_load()
    model.eval()
    logger.info(
        "loaded %s (%s) from %s: %d tensors, dtype=%s, device=%s in %.2fs",
        config.architecture,
        config.model_type,
        path,
        num_tensors,
        dtype,
        device,
        time.perf_counter() - start,
    )
    return model


def _assign_methods(model: CausalLM, quant: QuantConfig) -> None:
    """Hands every linear layer its method from ``quant``, by the checkpoint names of the
    weights it holds (a fused projection's stacked sources)."""
    stacked = model.stacked_params()
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or not module.quantizable:
            continue
        parent, _, short = name.rpartition(".")
        sources = tuple(f"{parent}.{s}" if parent else s for s in stacked.get(short, (short,)))
        method = quant.linear_method(sources)
        if method is not None:
            module.use_method(method)


def _default_backend() -> AttentionBackend:
    from services.engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


@torch.no_grad()
def load_weights(model: CausalLM, path: Path) -> int:
    """Copies every checkpoint tensor into ``model``; returns how many were loaded.

    Raises ValueError for a checkpoint tensor with no home, a shape mismatch, or a model
    parameter left unfilled.
    """
    params = dict(model.named_parameters())
    slots = _slot_table(model)
    tied = model.config.tie_word_embeddings
    filled: set[str] = set()
    filled_params: set[str] = set()
    count = 0
    for stored, file in _iter_checkpoint(path):
        name = model.checkpoint_name(stored)  # a family's checkpoint layout -> the model's
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue  # some tied checkpoints store the head anyway; ours is the embedding
        slot = slots.get(name)
        if slot is None and name.startswith(model.elsewhere):
            continue  # another pipeline stage's
        if slot is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching model parameter")
        target = params[slot.param].narrow(slot.dim, slot.offset, slot.rows)
        if slot.shard is None:
            tensor = file.get_tensor(stored)
        else:
            tensor, target = _read_shard(file, stored, slot.shard, target)
        if target.dtype not in SUPPORTED_DTYPES and tensor.dtype != target.dtype:
            raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype}; its quantized "
                             f"layer expects {target.dtype}")
        if not _fits(tensor.shape, target.shape):
            raise ValueError(
                f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, "
                f"model expects {tuple(target.shape)}"
            )
        if slot.shared and slot.param in filled_params and not torch.equal(
                target, tensor.to(target.device)):  # read to the host, held on the device
            raise ValueError(f"checkpoint tensor {name!r} differs from the one stacked with it "
                             f"into {slot.param!r}; a fused projection holds one")
        filled_params.add(slot.param)
        target.copy_(tensor)  # converts dtype and device in one go; broadcasts per-head norms
        filled.add(name)
        count += 1
    missing = sorted(set(slots) - filled)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint at {path} is missing {len(missing)} tensors: {shown}")
    return count


def _read_shard(
    file, name: str, shard: ShardRange, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reads only ``shard`` of the checkpoint tensor ``name``; returns it and the part of
    ``target`` it fills (vocabulary padding past the checkpoint's rows is zeroed)."""
    handle = file.get_slice(name)
    shape = handle.get_shape()
    if len(shape) <= shard.dim or shape[shard.dim] != shard.full:
        raise ValueError(
            f"shape mismatch for {name!r}: checkpoint {tuple(shape)}, model expects "
            f"{shard.full} along dim {shard.dim}"
        )
    stop = min(shard.start + shard.length, shard.full)
    index = tuple(
        slice(shard.start, stop) if d == shard.dim else slice(None) for d in range(len(shape))
    )
    got = stop - shard.start
    if got < target.shape[shard.dim]:
        target.narrow(shard.dim, got, target.shape[shard.dim] - got).zero_()
        target = target.narrow(shard.dim, 0, got)
    return handle[index], target


def _fits(src: torch.Size, dst: torch.Size) -> bool:
    """Exact match, or one row broadcast over a per-head slot (q_norm/k_norm -> HeadRMSNorm)."""
    return src == dst or (len(dst) == 2 and tuple(src) == (dst[1],))


def _slot_table(model: CausalLM) -> dict[str, _Slot]:
    """HF checkpoint name -> slot, for every parameter of ``model``.

    Fused modules (``qkv_proj`` ...) record the sizes of their stacked HF weights; each HF
    weight takes the next rows in the order ``stacked_params`` lists them.
    """
    stacked = model.stacked_params()
    modules = dict(model.named_modules())
    table: dict[str, _Slot] = {}
    for param_name, param in model.named_parameters():
        module_name, _, leaf = param_name.rpartition(".")
        parent, _, short = module_name.rpartition(".")
        module = modules[module_name]
        sources = stacked.get(short)
        if sources is None:
            table[param_name] = _Slot(param_name, 0, param.shape[0], _shard(module, leaf, 0))
            continue
        layout = module.method.layout(leaf) if isinstance(module, Linear) else ParamLayout()
        dim, pack = layout.output_dim, layout.output_pack
        offset = 0
        for i, (source, rows) in enumerate(zip(sources, module.shard_sizes, strict=True)):
            shard = _shard(module, leaf, i)
            table[f"{parent}.{source}.{leaf}"] = (
                _Slot(param_name, 0, param.shape[0], shard, shared=True) if dim is None
                else _Slot(param_name, offset // pack, rows // pack, shard, dim))
            offset += rows
    return table


def _shard(module: nn.Module, leaf: str, index: int) -> ShardRange | None:
    """The slice a tensor-parallel layer holds of its ``index``-th stacked source."""
    checkpoint_range = getattr(module, "checkpoint_range", None)
    return None if checkpoint_range is None else checkpoint_range(leaf, index)


def _iter_checkpoint(path: Path) -> Iterator[tuple[str, Any]]:
    """Yields (name, its open safetensors file) over every file of the checkpoint (memory-
    mapped): the caller reads the whole tensor or only its slice."""
    for file in _checkpoint_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in list(f.keys()):
                yield name, f


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {path}")
    return files
