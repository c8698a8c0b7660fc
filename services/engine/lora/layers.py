"""LoRA on the model's projections: per projection, every slot's stacked A and B, and the
batched apply.

``ModelLoRA`` attaches one ``LoRAProjection`` to each target projection (``Linear.addend``,
called by the projection on its output: before the all-reduce of a row-parallel one, so one
collective covers both). A projection with K slices (q/k/v stacked: 3) keeps, per slot::

    a[slot]: [in, K * R]    A^T of each slice side by side (R = max_lora_rank, zero-padded)
    b[slot]: [K * R, out]   B^T (scaled) of slice k in rows k*R.., at that slice's columns

so ``y += (x @ a[slot]) @ b[slot]`` applies every slice at once (zeros elsewhere). On a
tensor-parallel rank ``in``/``out`` are the rank's, A's columns (row-parallel) or B's rows
(column-parallel) cut as the base weight is.

Per step a projection reads ``state.step`` (``step.LoRAStep``): None does nothing; one adapter
for every token is two matmuls; otherwise the rows under adapters are gathered once, padded per
slot into one batched matmul each way (or, when padding would cost more, two matmuls per
adapter, added back with one ``index_add_``); a padded result is gathered back per token
and added. With ``segments`` (the Triton kernels), shrink and expand kernels over per-request
segments instead. ``stacked`` (CUDA graphs): every slot over every row, one batched matmul
down, the rows' other slots zeroed, one matmul up over all slots' B stacked.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from services.engine.lora import step as lora_step
from services.engine.lora import transfer
from services.engine.lora.peft import AdapterWeights
from services.engine.lora.step import DENSE, PADDED, SEGMENTS, STACKED, LoRAState, LoRAStep
from services.engine.lora.targets import LoRATargets
from services.engine.models.layers import CausalLM, Linear
from services.engine.parallel.group import TPGroup

# The Triton shrink/expand kernels are correct compiled (an H200, 2026-12-04) but not yet timed
# against the batched torch path there: CUDA engines use the torch path unless this is 1.
SEGMENT_KERNELS_ENV = "PAGODA_LORA_TRITON"


def segment_kernels_wanted(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get(SEGMENT_KERNELS_ENV) == "1"


class LoRAProjection:
    """One projection's slots (see the module docstring); called as ``lora(x, y)``."""

    def __init__(self, module: Linear, num_slices: int, state: LoRAState, num_slots: int,
                 max_rank: int, device: torch.device) -> None:
        out_local, in_local, dtype = module.out_features, module.in_features, module.dtype
        self.state = state
        self.max_rank = max_rank
        width = num_slices * max_rank
        self.a = torch.zeros(num_slots, in_local, width, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, width, out_local, dtype=dtype, device=device)
        self.a_slot = list(self.a.unbind(0))  # views, made once: no indexing per call
        self.b_slot = list(self.b.unbind(0))
        self.b_stacked = self.b.view(num_slots * width, out_local)  # every slot's B^T, in rows
        self.slot_ids = torch.arange(num_slots, device=device)
        sizes = module.shard_sizes
        if num_slices == 1:  # the whole (checkpoint-fused) projection is one slice
            self.spans = [(0, sum(sizes))]
        else:
            offsets = np.cumsum((0, *sizes))
            self.spans = [(int(offsets[i]), sizes[i]) for i in range(num_slices)]
        # This rank's cut of each slice, as of the base weight (None: all of it).
        ranged = getattr(module, "checkpoint_range", None)
        self.shards = [None if ranged is None else ranged("weight", i)
                       for i in range(num_slices)]

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        step = self.state.step
        if step is None:
            return y
        kind = step.kind
        if kind == DENSE:
            s = step.dense_slot
            return y.addmm_(torch.mm(x, self.a_slot[s]), self.b_slot[s])
        gather = step.gather
        if kind == PADDED:
            slots, width = len(self.a_slot), step.width
            h = torch.bmm(x.index_select(0, gather).view(slots, width, -1), self.a)
            delta = y.new_empty(slots * width + 1, y.shape[1])
            delta[-1].zero_()  # the row of base-model tokens
            torch.bmm(h, self.b, out=delta[:-1].view(slots, width, -1))
            return y.add_(delta.index_select(0, step.scatter))
        if kind == SEGMENTS:
            return self._segments(x, y, step)
        if kind == STACKED:
            return self._stacked(x, y, step.token_slots)
        xs = x.index_select(0, gather)  # GROUPED
        delta = y.new_empty(len(gather), y.shape[1])
        a, b = self.a_slot, self.b_slot
        for s, lo, hi in step.groups:
            torch.mm(torch.mm(xs[lo:hi], a[s]), b[s], out=delta[lo:hi])
        # Only the adapter rows are touched (a gathered add over every row measured slower
        # here: most of a long prompt's rows are then base rows or zero).
        return y.index_add_(0, gather, delta)

    def _segments(self, x: torch.Tensor, y: torch.Tensor, step: LoRAStep) -> torch.Tensor:
        from services.engine.lora import kernels

        h = torch.zeros(x.shape[0], self.a.shape[2], dtype=torch.float32, device=x.device)
        kernels.lora_shrink(x, self.a, step.segments, step.max_segment, h)
        kernels.lora_expand(h, self.b, step.segments, step.max_segment, y)
        return y

    def _stacked(self, x: torch.Tensor, y: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
        """Shapes depend on the row count only (a graph replays it for any slots): h[s, t] =
        x[t] @ a[s] for every slot, zero unless s is row t's slot, then y += h @ every B."""
        h = torch.matmul(x.unsqueeze(0), self.a)  # [slots, T, W]
        mine = (self.slot_ids.unsqueeze(1) == token_slots.unsqueeze(0)).to(h.dtype)
        h = h * mine.unsqueeze(-1)  # [slots, T, W]: zero where the slot is not the row's
        return y.addmm_(h.transpose(0, 1).reshape(x.shape[0], -1), self.b_stacked)

    @torch.no_grad()
    def install(self, slot: int, tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] | None
                ) -> None:
        """Writes an adapter's slices into ``slot`` (zeros where it has none)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for i, (a, b) in (tensors or {}).items():
            shard = self.shards[i]
            if shard is not None and shard.dim == 0:  # column-parallel: this rank's B rows
                b = b.narrow(0, shard.start, shard.length)
            elif shard is not None and shard.dim == 1:  # row-parallel: this rank's A columns
                a = a.narrow(1, shard.start, shard.length)
            r, col = a.shape[0], i * self.max_rank
            start, rows = self.spans[i]
            self.a[slot, :, col : col + r].copy_(a.t())
            self.b[slot, col : col + r, start : start + rows].copy_(b.t())


class ModelLoRA:
    """Every LoRA projection of one model (one rank's shard), their shared step field, and
    the copies into slots."""

    def __init__(self, model: CausalLM, max_loras: int, max_rank: int, device: torch.device,
                 segments: bool = False) -> None:
        self.targets = LoRATargets(model)
        self.state = LoRAState()
        self.device = device
        self.max_rank = max_rank
        self.num_slots = max_loras
        self.segments = segments
        self.dtype = next(iter(self.targets.modules.values())).dtype
        self.projections: dict[str, LoRAProjection] = {}
        for path, module in self.targets.modules.items():
            proj = LoRAProjection(module, self.targets.num_slices[path], self.state, max_loras,
                                  max_rank, device)
            module.addend = proj
            self.projections[path] = proj

    def layout(self, seq_slots: np.ndarray, query_lens: np.ndarray) -> LoRAStep | None:
        """A step's ``LoRAStep`` (None without adapter tokens); built with the step's inputs."""
        return lora_step.build(seq_slots, query_lens, self.num_slots, self.device,
                               self.segments)

    def installs(self, taken: list[tuple[int, AdapterWeights]]
                 ) -> list[tuple[int, np.ndarray, AdapterWeights]]:
        """Rank 0: a step's copies into slots as its batch carries them (``transfer``)."""
        paths = list(self.projections)
        return [(slot, transfer.manifest(w, paths), w) for slot, w in taken]

    def apply_installs(self, installs: list[tuple[int, np.ndarray, AdapterWeights | None]],
                       tp: TPGroup) -> None:
        """Every rank, before the step that first reads the slots: the copies into them (the
        other ranks receive rank 0's validated tensors; none opens a file)."""
        paths = list(self.projections)
        for slot, plan, weights in installs:
            tensors = weights.tensors if tp.size == 1 else \
                transfer.share(tp, plan, weights, paths, self.dtype)
            for path, proj in self.projections.items():
                proj.install(slot, tensors.get(path))
