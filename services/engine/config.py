"""Engine configuration: one validated dataclass; the server's CLI flags map onto it one to one."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # HF directory; None = the default model (converted on first use)
    served_model_name: str | None = None  # the name clients use; defaults to the directory name
    dtype: str = "auto"  # auto = float32 on the CPU, bfloat16 on a GPU
    device: str = "auto"  # auto = cuda when available
    block_size: int = 16
    num_blocks: int | None = None  # fixes the KV pool size; else sized from kv_cache_memory
    kv_cache_memory: int | None = None  # bytes for the KV pool; None = a default per device
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024  # per-step token budget (prefill is chunked to fit)
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    enable_prefix_caching: bool = True
    attention_backend: str | None = None  # None = automatic (triton on CUDA, torch on CPU)
    hash_algorithm: str = "xxh3_128"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            _require_positive(name, getattr(self, name))
        for name in ("num_blocks", "kv_cache_memory", "max_model_len"):
            if getattr(self, name) is not None:
                _require_positive(name, getattr(self, name))

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return _DTYPES[self.dtype]


def _require_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
