"""Megatron-style parallel layers: built like ``models.layers.Linear``/``Embedding``, sharded
over the group being built (``group.building``); at one rank they are exactly those layers.

* ``ColumnParallelLinear``: output rows split (Q/K/V, gate/up); no communication.
* ``RowParallelLinear``: input columns split (o_proj, down); one all-reduce of the output.
* ``VocabParallelEmbedding`` / ``ParallelLMHead``: vocabulary rows split; the lookup is summed
  over the ranks (one all-reduce), the logits are gathered on rank 0.

Each layer tells the loader which slice of a checkpoint tensor it holds (``checkpoint_range``),
so a rank reads only its slice from safetensors. They work with both weight paths: the plain
``F.linear`` and the oneDNN-packed one (each rank packs its own shard).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.engine.models.layers import Embedding, Linear
from services.engine.models.partition import head_shard, vocab_shard
from services.engine.parallel.group import TPGroup, current


@dataclass(frozen=True, slots=True)
class ShardRange:
    """The slice of a checkpoint tensor a rank holds: ``[start, start + length)`` along
    ``dim``, whose full length is ``full`` (``length`` may run past it: vocabulary padding)."""

    dim: int
    start: int
    length: int
    full: int


class ColumnParallelLinear(Linear):
    """``Linear`` whose stacked weights each keep one contiguous block of rows per rank."""

    def __init__(
        self,
        in_features: int,
        shard_sizes: tuple[int, ...],
        bias: bool,
        dtype: torch.dtype,
        starts: tuple[int, ...] | None = None,
        full_sizes: tuple[int, ...] | None = None,
    ) -> None:
        """``shard_sizes``: the full rows of each stacked weight, split evenly unless
        ``starts``/``full_sizes`` say otherwise (then ``shard_sizes`` are this rank's rows)."""
        tp = current()
        if starts is None:
            full_sizes = shard_sizes
            assert all(s % tp.size == 0 for s in shard_sizes), (shard_sizes, tp.size)
            shard_sizes = tuple(s // tp.size for s in shard_sizes)
            starts = tuple(tp.rank * s for s in shard_sizes)
        super().__init__(in_features, shard_sizes, bias, dtype)
        self.tp = tp
        self._starts = starts
        self._full = full_sizes

    def checkpoint_range(self, leaf: str, index: int) -> ShardRange | None:
        layout = self.method.layout(leaf)
        dim, p = layout.output_dim, layout.output_pack
        if self.tp.size == 1 or dim is None:
            return None
        return ShardRange(dim, self._starts[index] // p, self.shard_sizes[index] // p,
                          self._full[index] // p)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused Q/K/V over this rank's heads (``partition.head_shard``); ``num_heads``,
    ``num_kv_heads``, ``q_size`` and ``kv_size`` are the local ones."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        dtype: torch.dtype,
    ) -> None:
        tp = current()
        heads = head_shard(num_heads, num_kv_heads, tp.rank, tp.size)
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.q_size, self.kv_size = heads.num_heads * head_dim, heads.num_kv_heads * head_dim
        q_start, kv_start = heads.first_head * head_dim, heads.first_kv_head * head_dim
        full_q, full_kv = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(
            hidden_size,
            (self.q_size, self.kv_size, self.kv_size),
            bias,
            dtype,
            starts=(q_start, kv_start, kv_start),
            full_sizes=(full_q, full_kv, full_kv),
        )


class RowParallelLinear(Linear):
    """``Linear`` over this rank's block of input columns; the partial outputs are summed
    (one all-reduce). The bias is added once, by rank 0."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        tp = current()
        assert in_features % tp.size == 0, (in_features, tp.size)
        super().__init__(in_features // tp.size, (out_features,), bias, dtype,
                         full_in_features=in_features)
        self.tp = tp

    def checkpoint_range(self, leaf: str, index: int) -> ShardRange | None:
        layout = self.method.layout(leaf)  # a bias or per-channel scale: all of it
        dim, p = layout.input_dim, layout.input_pack
        if self.tp.size == 1 or dim is None:
            return None
        full = self.full_in_features
        local = full // self.tp.size // p
        return ShardRange(dim, self.tp.rank * local, local, full // p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x, self.bias if self.tp.is_first else None)
        if self.addend is not None:  # this rank's partial product too: one all-reduce for both
            y = self.addend(x, y)
        return self.tp.all_reduce(y)

    def pack(self) -> None:
        if not self.tp.is_first:
            self.bias = None  # loaded everywhere (one checkpoint entry), added by rank 0 only
        super().pack()


class _VocabShard:
    """The vocabulary rows one rank holds: ``[start, start + real)``, padded to ``rows``."""

    tp: TPGroup
    vocab_size: int

    def _set_vocab(self, vocab_size: int) -> int:
        self.tp = current()
        self.vocab_size = vocab_size
        rows, self.vocab_start, self.vocab_real = vocab_shard(vocab_size, self.tp.rank,
                                                              self.tp.size)
        return rows

    def checkpoint_range(self, leaf: str, index: int) -> ShardRange | None:
        if self.tp.size == 1:
            return None
        rows = -(-self.vocab_size // self.tp.size)
        return ShardRange(0, self.vocab_start, rows, self.vocab_size)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor | None:
        """This rank's ``[n, rows]`` logits -> the whole vocabulary's on rank 0, None on the
        others (only rank 0 samples)."""
        if self.tp.size == 1:
            return logits
        parts = self.tp.gather_first(logits)
        return None if parts is None else torch.cat(parts, dim=1)[:, : self.vocab_size]


class VocabParallelEmbedding(_VocabShard, Embedding):
    """Token embeddings split by vocabulary rows: each rank looks up the ids it holds (zeros
    for the others) and the lookups are summed. Also the LM head when embeddings are tied."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        rows = self._set_vocab(vocab_size)
        Embedding.__init__(self, rows, hidden_size, dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_real)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(_VocabShard, Linear):
    """An untied LM head split by vocabulary rows (logits gathered by ``gather_logits``)."""

    def __init__(self, hidden_size: int, vocab_size: int, dtype: torch.dtype) -> None:
        rows = self._set_vocab(vocab_size)
        Linear.__init__(self, hidden_size, (rows,), False, dtype)
