"""Reads a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) and
checks it against the base model, before anything of it is used.

Supported: ``peft_type`` LORA, ``r`` up to ``max_lora_rank``, ``lora_alpha``, ``use_rslora``
(scaling ``alpha / sqrt(r)`` instead of ``alpha / r``), target modules among the model's
``targets.LoRATargets`` (given as a list or as PEFT's regex string: the tensors decide),
``layers_to_transform`` (only the layers present are applied). Refused, with a ``BadRequest``
whose ``param`` names the config field (or ``lora_path`` for the files) and whose message names
the module: DoRA, ``modules_to_save``, embedding and LM-head targets, LoRA biases,
``fan_in_fan_out``, per-module rank or alpha patterns, any other PEFT method, a rank above the
limit, tensors whose shapes belong to another base model, a module the model has no target
for, an A without its B, a tensor of a non-floating dtype, a file that does not parse, a
missing path.

Each file is opened from its directory's descriptor (``paths.AdapterSource``), checked to be a
regular file under the size cap and read once into memory with a deadline (``files``), then
parsed from those bytes by ``parse_safetensors`` (never memory-mapped: a file replaced later
cannot change weights in use; a header's claims are checked against the bytes before anything
is allocated); its bytes also make the adapter's version, the first 16 hex digits of their
SHA-256, which the block-hash chain carries. ``read_adapter`` touches nothing but the files
and the immutable targets: the loader thread runs it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.engine.lora.files import READ_DEADLINE_S, read_file
from services.engine.lora.paths import AdapterSource
from services.engine.lora.targets import EMBEDDING_NAMES, LoRATargets
from services.protocol.block_hash import AdapterKey
from services.protocol.wire import BadRequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_MAX_CONFIG_BYTES = 1 << 20
_HEADER_SLACK = 64 << 10  # the header's fixed part and __metadata__
_HEADER_PER_TENSOR = 256  # one tensor's entry in the header (its name, dtype, shape, offsets)
_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
           "F64": torch.float64}
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.default)?"
                  r"\.weight$")
# Config fields whose non-empty value asks for something this engine does not do.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora) is not supported",
    "modules_to_save": "modules_to_save (fully trained modules) is not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers) is not supported",
    "rank_pattern": "per-module ranks (rank_pattern) are not supported",
    "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
    "lora_bias": "LoRA biases (lora_bias) are not supported",
    "target_parameters": "target_parameters is not supported",
    "trainable_token_indices": "trainable_token_indices is not supported",
    "layer_replication": "layer_replication is not supported",
    "use_qalora": "QALoRA (use_qalora) is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
}


@dataclass(eq=False, slots=True)
class AdapterWeights:
    """A validated adapter in host memory: per target projection (our module path), per
    slice, ``(A [r, in], B [rows, r] * scaling)`` of the full model, in the model's dtype."""

    name: str
    path: str
    version: str
    rank: int
    scaling: float
    tensors: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(repr=False)
    nbytes: int = 0
    int_id: int | None = None  # the caller's LoRARequest id, when it gave one

    @property
    def key(self) -> AdapterKey:
        return AdapterKey(self.name, self.version)


def read_adapter(
    name: str,
    source: AdapterSource | str | Path,
    targets: LoRATargets,
    max_rank: int,
    dtype: torch.dtype,
    max_file_bytes: int | None = None,
) -> AdapterWeights:
    """Reads and validates the adapter at ``source`` (a path: an operator's own, opened as
    given); ``max_file_bytes``: the weights file's cap (default: ``max_file_size``). Any
    thread: it reads only the immutable ``targets``."""
    if not isinstance(source, AdapterSource):
        source = AdapterSource.of(source)
    cap = max_file_bytes or max_file_size(targets, max_rank)
    deadline = time.monotonic() + READ_DEADLINE_S
    fd = source.open_dir()
    try:
        config_bytes = _read(fd, CONFIG_FILE, _MAX_CONFIG_BYTES, deadline, source)
        weights_bytes = _read(fd, WEIGHTS_FILE, cap, deadline, source)
    finally:
        os.close(fd)
    config = _parse_config(config_bytes)
    rank, scaling = _check_config(config, targets, max_rank)
    digest = hashlib.sha256(config_bytes)
    digest.update(b"\x00")
    digest.update(weights_bytes)  # no copy of the weights' bytes
    version = digest.hexdigest()[:16]
    tensors = _check_tensors(parse_safetensors(weights_bytes), targets, rank, scaling, dtype)
    nbytes = sum(a.nbytes + b.nbytes for s in tensors.values() for a, b in s.values())
    return AdapterWeights(name, source.shown, version, rank, scaling, tensors, nbytes)


def max_file_size(targets: LoRATargets, max_rank: int) -> int:
    """The largest legal weights file: every target slice at ``max_rank`` in float32, plus a
    header's worth per tensor (the default of --max-lora-file-bytes)."""
    tensors = sum(max_rank * (s.in_features + s.rows) * 4 for s in targets.slices.values())
    return tensors + _HEADER_SLACK + 2 * len(targets.slices) * _HEADER_PER_TENSOR


def _read(dir_fd: int, name: str, cap: int, deadline: float, source: AdapterSource
          ) -> bytearray:
    try:
        return read_file(dir_fd, name, cap, deadline, source.confined)
    except FileNotFoundError:
        if name == WEIGHTS_FILE and _exists(dir_fd, "adapter_model.bin"):
            raise BadRequest("adapter_model.bin (pickle) is not read: save the adapter with "
                             "safetensors", "lora_path") from None
        raise BadRequest(f"the adapter has no {name}", "lora_path") from None


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return True


def parse_safetensors(data: bytearray) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file's bytes (8-byte little-endian header length, a JSON
    header of name -> dtype, shape, data_offsets, then the data). Every claim of the header is
    checked against the bytes there are before anything is allocated; floating dtypes only."""
    size = len(data)
    header_len = int.from_bytes(data[:8], "little") if size >= 8 else -1
    if not 0 <= header_len <= size - 8:
        raise _corrupt(f"its header claims {header_len} bytes of {max(size - 8, 0)}")
    try:
        header = json.loads(bytes(data[8 : 8 + header_len]))
    except (ValueError, RecursionError):
        raise _corrupt("its header is not JSON") from None
    if not isinstance(header, dict):
        raise _corrupt("its header is not a JSON object")
    start = 8 + header_len
    out = {}
    for key, info in header.items():
        if key != "__metadata__":
            out[key] = _tensor(data, start, key, info)
    return out


def _tensor(data: bytearray, start: int, key: str, info: object) -> torch.Tensor:
    if not isinstance(info, dict):
        raise _corrupt(f"tensor {key!r} has no description")
    dtype = _DTYPES.get(info.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise BadRequest(f"adapter tensor {key!r} has dtype {info.get('dtype')!r}: LoRA weights "
                         f"are floating point ({', '.join(_DTYPES)})", "lora_path")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not _ints(shape) or not _ints(offsets) or len(offsets) != 2:
        raise _corrupt(f"tensor {key!r} has a bad shape or data_offsets")
    begin, end = offsets
    count = math.prod(shape)
    if not (begin <= end <= len(data) - start and end - begin == count * dtype.itemsize):
        raise _corrupt(f"tensor {key!r}'s data_offsets do not fit its shape or the file")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype, count=count, offset=start + begin).view(shape)


def _ints(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def _corrupt(why: str) -> BadRequest:
    return BadRequest(f"{WEIGHTS_FILE} is corrupt: {why}", "lora_path")


def _parse_config(data: bytes) -> dict[str, Any]:
    try:
        config = json.loads(data)
    except (ValueError, RecursionError):
        raise BadRequest(f"{CONFIG_FILE} is not valid JSON", "lora_path") from None
    if not isinstance(config, dict):
        raise BadRequest(f"{CONFIG_FILE} must hold a JSON object", "lora_path")
    return config


def _check_config(config: dict[str, Any], targets: LoRATargets, max_rank: int
                  ) -> tuple[int, float]:
    """Returns (rank, scaling)."""
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise BadRequest(f"peft_type {kind!r} is not supported: only LORA", "peft_type")
    for key, why in _UNSUPPORTED.items():
        if config.get(key):
            raise BadRequest(f"{why}: refused", key)
    if config.get("bias", "none") != "none":
        raise BadRequest(f"bias {config['bias']!r} is not supported: only 'none'", "bias")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise BadRequest(f"r must be a positive integer, got {rank!r}", "r")
    if rank > max_rank:
        raise BadRequest(f"r={rank} is above this engine's --max-lora-rank {max_rank}", "r")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise BadRequest(f"lora_alpha must be a number, got {alpha!r}", "lora_alpha")
    _check_target_names(config.get("target_modules"), targets)
    rslora = bool(config.get("use_rslora", False))
    return rank, alpha / (math.sqrt(rank) if rslora else rank)


def _check_target_names(names: Any, targets: LoRATargets) -> None:
    if isinstance(names, str) or names is None:
        return  # a regex (or "all-linear"): the tensors say which modules it reached
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise BadRequest("target_modules must be a list of module names or a regex",
                         "target_modules")
    for n in names:
        short = n.rpartition(".")[2]
        if short in EMBEDDING_NAMES:
            raise BadRequest(f"target module {n!r} is an embedding or the LM head: only the "
                             "attention and MLP projections take LoRA", "target_modules")
        if short not in targets.short_names:
            raise BadRequest(f"target module {n!r} is not supported on this model (LoRA goes "
                             f"on {', '.join(sorted(targets.short_names))})", "target_modules")


def _check_tensors(
    raw: dict[str, torch.Tensor], targets: LoRATargets, rank: int, scaling: float,
    dtype: torch.dtype,
) -> dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in raw.items():
        m = _KEY.match(key)
        if m is None:
            raise BadRequest(f"adapter tensor {key!r} is not a LoRA A or B weight (DoRA "
                             "magnitudes, embeddings and saved modules are not supported)",
                             "target_modules")
        pairs.setdefault(m["module"], {})[m["ab"]] = tensor
    if not pairs:
        raise BadRequest(f"{WEIGHTS_FILE} holds no LoRA weights", "lora_path")
    out: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for module, ab in sorted(pairs.items()):
        target = targets.lookup(module)
        if target is None:
            short = module.rpartition(".")[2]
            what = "an embedding or the LM head" if short in EMBEDDING_NAMES else \
                "not a projection this engine applies LoRA to (q/k/v/o and gate/up/down of " \
                "dense layers)"
            raise BadRequest(f"module {module!r} is {what}", "target_modules")
        if set(ab) != {"A", "B"}:
            raise BadRequest(f"module {module!r} has lora_{''.join(ab)} without its pair",
                             "lora_path")
        a, b = ab["A"], ab["B"]
        want_a, want_b = (rank, target.in_features), (target.rows, rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise BadRequest(
                f"module {module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do "
                f"not fit this base model (expects {want_a} and {want_b}): an adapter of "
                "another model?", "lora_path")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise BadRequest(f"module {module!r} has non-finite weights", "lora_path")
        scaled_b = (b.to(torch.float32) * scaling).to(dtype)
        # Copies: nothing kept may share the file's buffer (freed once read).
        out.setdefault(target.module, {})[target.index] = (a.to(dtype, copy=True), scaled_b)
    return out
