"""LoRA as a step feature (as vLLM's LoRA model-runner mixin): the runner reaches adapters only
through this object.

Rank 0 keeps each input-batch row's device slot (-1: the base model): a row under an adapter
takes a slot when it joins and gives it back when it leaves (``DeviceSlots``), and a step
gathers its rows' slots and the adapters installed since the last step into its ``StepBatch``,
which crosses to the other ranks. Every rank then installs those adapters and sets the step's
layout (``LoRAStep``) on the state its projections read, just before the forward, and clears it
after. A step with no adapter token carries no slots and does no LoRA work at all.

CUDA graphs (on a GPU unless ``PAGODA_LORA_GRAPHS=0``; first run on an H200 on 2026-12-04,
tokens equal to peft's merged model): decode
steps under adapters replay graphs of their own, captured with the ``stacked`` layout over a
static buffer of each row's slot, the slots holding whatever adapters (dummy ones: zeros) they
hold at capture; the graph reads the slots' weights where they are, so installs between
replays show. Before a replay the step's slots are written into that buffer (-1 for padding
rows). Off, a decode step under adapters runs eager and base-model steps replay as before.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from services.engine.features import registry
from services.engine.features.protocol import (
    EAGER,
    FeatureFactory,
    ModelRunner,
    Request,
    StepFeature,
    StepRows,
)
from services.engine.lora.layers import ModelLoRA, segment_kernels_wanted
from services.engine.lora.manager import LoRAManager
from services.engine.lora.step import STACKED, LoRAStep
from services.engine.parallel.step_broadcast import register_section

if TYPE_CHECKING:
    from services.engine.models.layers import CausalLM
    from services.engine.parallel.group import TPGroup
    from services.engine.parallel.step_broadcast import StepBatch


# Set to 1 on a GPU: decode steps under adapters replay CUDA graphs of their own.
GRAPHS_ENV = "PAGODA_LORA_GRAPHS"
_GRAPH_PART = "lora"
SECTION = "lora"  # the feature's name, and its section of a step (``StepBatch.sections``)


@dataclass(slots=True)
class LoRAWire:
    """The feature's part of a step, as every rank needs it: each request's adapter slot (-1:
    the base model; None when no request has one), and the copies into slots to do before
    the step: (slot, manifest, weights), the weights on rank 0 only (it broadcasts their
    bytes to the other ranks: ``lora.transfer``)."""

    slots: np.ndarray | None = None
    installs: list[tuple[int, np.ndarray, Any]] = field(default_factory=list)

    def to_wire(self) -> np.ndarray:
        """[num slots, slots..., num installs, then per install: slot, manifest length,
        manifest]."""
        slots = self.slots if self.slots is not None else np.zeros(0, np.int64)
        parts = [np.asarray([len(slots)], np.int64), slots.astype(np.int64, copy=False),
                 np.asarray([len(self.installs)], np.int64)]
        for slot, plan, _ in self.installs:
            parts += [np.asarray([slot, len(plan)], np.int64), plan.astype(np.int64, copy=False)]
        return np.concatenate(parts)

    @classmethod
    def from_wire(cls, data: np.ndarray) -> LoRAWire:
        n = int(data[0])
        wire = cls(data[1 : 1 + n].copy() if n else None)
        at = 2 + n
        for _ in range(int(data[1 + n])):
            slot, size = int(data[at]), int(data[at + 1])
            wire.installs.append((slot, data[at + 2 : at + 2 + size].copy(), None))
            at += 2 + size
        return wire


register_section(SECTION, LoRAWire.from_wire)


def _wire(batch: StepBatch) -> LoRAWire:
    return batch.sections.get(SECTION) or _NONE  # type: ignore[return-value]


_NONE = LoRAWire()  # a step with no adapter row and no install (never written to)


class LoRALimits(Protocol):
    """The engine flags the feature reads (``EngineConfig``'s LoRA fields)."""

    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int | None
    max_lora_file_bytes: int | None
    max_num_seqs: int


class LoRAFeature(StepFeature):
    name = SECTION

    def __init__(self, lora: ModelLoRA, max_rows: int, tp: TPGroup, graphs: bool = False) -> None:
        """``graphs``: decode steps under adapters replay graphs of their own (see the module
        docstring)."""
        self.lora = lora
        self.manager: LoRAManager | None = None  # rank 0's adapters (``serve_adapters``)
        self.tp = tp
        self.slot = np.full(max_rows, -1, dtype=np.int64)
        self.rows = 0  # live rows under an adapter
        self.graphs = graphs
        # The graphs' static layout: each replayed row's slot (-1: base model or padding).
        self.graph_slots = torch.full((max_rows,), -1, dtype=torch.int64, device=lora.device)

    @classmethod
    def build(
        cls, model: CausalLM, config: LoRALimits, device: torch.device, tp: TPGroup
    ) -> LoRAFeature | None:
        """Every rank's adapter slots in ``model`` (before its weights are packed: they read
        the weights' shapes); None unless ``enable_lora``."""
        if not config.enable_lora:
            return None
        lora = ModelLoRA(
            model, config.max_loras, config.max_lora_rank, device, segment_kernels_wanted(device)
        )
        graphs = device.type == "cuda" and os.environ.get(GRAPHS_ENV, "1") != "0"
        return cls(lora, config.max_num_seqs, tp, graphs)

    def serve_adapters(self, config: LoRALimits, dtype: torch.dtype) -> None:
        """Rank 0: the adapters' manager (the engine thread's), whose slots rows take."""
        self.manager = LoRAManager(
            self.lora.targets,
            config.max_loras,
            config.max_lora_rank,
            config.max_cpu_loras,
            dtype,
            config.max_lora_file_bytes,
        )

    # -- rows (rank 0) ----------------------------------------------------------------------

    def join(self, req: Request, row: int) -> None:
        if req.adapter is not None:
            self.slot[row] = self.manager.slots.acquire(req.adapter)
            self.rows += 1
        else:
            self.slot[row] = -1

    def leave(self, req: Request, row: int) -> None:
        if self.slot[row] >= 0:
            self.manager.slots.release(int(self.slot[row]))
            self.rows -= 1
        self.slot[row] = -1

    def move(self, src: int, dst: int) -> None:
        self.slot[dst] = self.slot[src]
        self.slot[src] = -1

    def prepare_rows(self, rows: StepRows) -> None:
        """The rows' slots (a gathered copy; None when no live row has an adapter) and the
        adapters to install before the step."""
        slots = self.slot[rows.rows] if self.rows else None
        installs = self.lora.installs(self.manager.slots.take_installs())
        if slots is not None or installs:
            rows.batch.sections[SECTION] = LoRAWire(slots, installs)

    # -- the step (every rank) --------------------------------------------------------------

    def host_inputs(self, batch: StepBatch) -> LoRAStep | None:
        slots = _wire(batch).slots
        return None if slots is None else self.lora.layout(slots, batch.query_lens)

    def graph_key(self, batch: StepBatch) -> Hashable | None:
        # Without graphs of its own, a step with adapters runs eager.
        if _wire(batch).slots is None:
            return None
        return _GRAPH_PART if self.graphs else EAGER

    def graph_variants(self) -> list[Hashable]:
        return [_GRAPH_PART] if self.graphs else []

    def capture_forward(self, part: Hashable, num_rows: int) -> None:
        self.lora.state.step = self.stacked(num_rows)

    def stacked(self, num_rows: int) -> LoRAStep:
        """The static layout of a graph of ``num_rows`` rows (a view of ``graph_slots``)."""
        return LoRAStep(STACKED, token_slots=self.graph_slots[:num_rows])

    def before_replay(self, batch: StepBatch, num_rows: int) -> None:
        """A decode step (one token per row): its rows' slots into the static buffer, the
        padding rows' to -1."""
        wire = _wire(batch)
        if wire.installs:
            self.lora.apply_installs(wire.installs, self.tp)
        assert wire.slots is not None
        n = len(wire.slots)
        assert n == len(batch.input_ids) and n <= num_rows, "graphs replay decode steps only"
        self.graph_slots[n:num_rows].fill_(-1)
        self.graph_slots[:n].copy_(torch.from_numpy(wire.slots))

    def before_forward(self, batch: StepBatch, host: Any) -> None:
        wire = _wire(batch)
        if wire.installs:  # on the step thread, after the steps that read those slots
            self.lora.apply_installs(wire.installs, self.tp)
        if host is None and wire.slots is not None:
            host = self.lora.layout(wire.slots, batch.query_lens)
        self.lora.state.step = host  # read by every LoRA projection of this step

    def after_forward(self) -> None:
        self.lora.state.step = None

    # -- before serving ---------------------------------------------------------------------

    def warm_up(self, runner: ModelRunner) -> list[str]:
        """A forward with every token on adapter slot 0 (zeros: no effect), so the
        shrink/expand products (Triton with ``PAGODA_LORA_TRITON``) run once."""
        n = min(16, runner.config.max_num_batched_tokens, runner.num_blocks * runner.block_size)
        self.lora.state.step = self.lora.layout(np.zeros(1, np.int64), np.array([n]))
        try:
            runner.warm_up_forward(n)
        finally:
            self.lora.state.step = None
        return ["LoRA layout"]

    def held_bytes(self, device: torch.device) -> int:
        """The slots' A and B weights (on a GPU already out of the free memory the KV budget
        is read from: counted on the CPU only)."""
        return slot_bytes(self.lora)


class LoRAFactory(FeatureFactory):
    """The runner builds the feature through ``features.registry``: every rank's slots before
    the weights are packed, then rank 0's adapters' manager after the KV pool."""

    name = SECTION

    def __init__(self) -> None:
        self.feature: LoRAFeature | None = None

    def before_packing(self, runner: ModelRunner) -> LoRAFeature | None:
        self.feature = LoRAFeature.build(runner.model, runner.config, runner.device, runner.tp)
        return self.feature

    def build(self, runner: ModelRunner) -> None:
        """Rank 0: the feature is already in the step's order (``before_packing``)."""
        assert self.feature is not None
        self.feature.serve_adapters(runner.config, runner.dtype)


def _make(runner: ModelRunner) -> LoRAFactory | None:
    return LoRAFactory() if runner.config.enable_lora else None


registry.register(SECTION, _make)


def slot_bytes(lora: ModelLoRA | None) -> int:
    """The adapter slots' A and B weights of every projection."""
    if lora is None:
        return 0
    return sum(p.a.nbytes + p.b.nbytes for p in lora.projections.values())
