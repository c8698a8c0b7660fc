"""Which part of the model each rank holds (Megatron style), and the sizes that allow it.

Query heads and MLP rows split evenly. KV heads split evenly too; when there are fewer KV heads
than ranks each is replicated over ``size / num_kv_heads`` consecutive ranks (as vLLM), which
keeps every rank's query heads with the KV head they attend to. The vocabulary is padded up to
a multiple of the rank count; the padding rows are zeros and their logits are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.engine.models.registry import get_arch_spec

if TYPE_CHECKING:
    from services.engine.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class HeadShard:
    """One rank's attention heads: local counts and the first global head of each kind."""

    num_heads: int
    num_kv_heads: int
    first_head: int
    first_kv_head: int


def check_sizes(config: ModelConfig, size: int) -> None:
    """Raises ValueError, naming the numbers, when the model cannot be split ``size`` ways."""
    if size == 1:
        return

    where = f"tensor_parallel_size={size}"
    if not get_arch_spec(config.architecture).tensor_parallel:
        raise ValueError(f"{where}: {config.architecture} runs on one rank only (use 1)")
    if config.num_heads % size:
        raise ValueError(
            f"{where} must divide the model's {config.num_heads} attention heads "
            f"(try {_divisors(config.num_heads)})"
        )
    kv = config.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(
            f"{where} and the model's {kv} KV heads: one must divide the other "
            "(KV heads are split across ranks, or replicated when fewer than the ranks)"
        )
    if config.intermediate_size % size:
        raise ValueError(
            f"{where} must divide the model's intermediate_size {config.intermediate_size}"
        )


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def head_shard(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadShard:
    local = num_heads // size
    if num_kv_heads >= size:
        local_kv = num_kv_heads // size
        first_kv = rank * local_kv
    else:  # replicated: ranks [k * size/kv, (k+1) * size/kv) share KV head k
        local_kv = 1
        first_kv = rank * num_kv_heads // size
    return HeadShard(local, local_kv, rank * local, first_kv)


def local_kv_heads(config: ModelConfig, size: int) -> int:
    return head_shard(config.num_heads, config.num_kv_heads, 0, size).num_kv_heads


def vocab_shard(vocab_size: int, rank: int, size: int) -> tuple[int, int, int]:
    """(rows per rank incl. padding, first vocab id of this rank, real rows of this rank)."""
    rows = -(-vocab_size // size)
    start = min(rank * rows, vocab_size)
    return rows, start, min(rows, vocab_size - start)
