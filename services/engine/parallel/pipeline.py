"""Pipeline parallelism's ranks, and what passes between its stages.

An engine with P stages of T tensor-parallel ranks each has P x T ranks. Rank 0 (the engine
process, or the leader pod) keeps the scheduler and samples, so it runs the *last* stage, whose
LM head makes the logits it samples from: ranks ``0..T-1`` are the last stage, ranks
``T..2T-1`` stage 0, the next T stage 1, and so on. Within a stage the T ranks form the
tensor-parallel group its layers talk through (``stage_group``).

A step travels down the pipeline: rank 0 hands the step's batch to every rank of stage 0
(``submit``); each rank of a stage runs its layers and hands the batch and its output
(``IntermediateTensors``: hidden states and residual) to the rank of the next stage with its
own tensor-parallel index (``send``); rank 0 needs only the tensors, having the batch. Every
hand-off is point-to-point on the world's gloo group (the step group), sent without waiting
(``isend``, so no stage waits for the next to be ready) and received in order: stages
process the batches in the order rank 0 submitted them, which is what lets rank 0 keep
several in flight (``pipeline_batches``). A stop travels the same way.

A dead or hung rank: the same watch as tensor parallelism's (``workers``, ``heartbeat``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from services.engine.parallel import group as tp_group
from services.engine.parallel.group import TPGroup
from services.engine.parallel.step_broadcast import StepBatch, decode, encode

_STEP, _STOP = 1, 0


def payload_limit(max_tokens: int, max_seqs: int, max_blocks: int) -> int:
    """The most int64 words an encoded step can hold (``step_broadcast.encode``): its header,
    ids, per-request lengths, logits rows, prompt-logprob slices and block tables. A peer's
    header announcing more is refused before anything is allocated for it."""
    return 6 + max_tokens + 7 * max_seqs + max_seqs * max_blocks


def check_payload(length: int, limit: int) -> None:
    if not 0 <= length <= limit:
        raise RuntimeError(f"a pipeline peer announced a step of {length} words; at most "
                           f"{limit} fit this engine's limits")


@dataclass(frozen=True, slots=True)
class PipelineRank:
    """Where global ``rank`` stands among ``pp`` stages of ``tp`` ranks each."""

    rank: int
    pp: int
    tp: int

    @property
    def stage(self) -> int:
        return (self.rank // self.tp - 1) % self.pp  # rank 0's ranks run the last stage

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    def global_rank(self, stage: int, tp_rank: int) -> int:
        return (stage + 1) % self.pp * self.tp + tp_rank

    def stage_ranks(self, stage: int) -> list[int]:
        return [self.global_rank(stage, j) for j in range(self.tp)]

    @property
    def next(self) -> int | None:
        """The rank this one hands its output to (None on the last stage)."""
        if self.stage == self.pp - 1:
            return None
        return self.global_rank(self.stage + 1, self.tp_rank)

    @property
    def prev(self) -> int:
        """The rank this one receives its steps from: rank 0 for stage 0 (rank 0 itself
        receives its stage's input from the last-but-one stage)."""
        if self.stage == 0:
            return 0
        return self.global_rank(self.stage - 1, self.tp_rank)


def stage_group(world: TPGroup, where: PipelineRank, device: torch.device) -> TPGroup:
    """This rank's tensor-parallel group within its stage. Every rank creates every stage's
    groups, in the same order (``new_group`` is collective over the world)."""
    if where.tp == 1:
        return tp_group.SINGLE
    backend = "nccl" if device.type == "cuda" else "gloo"
    mine = tp_group.SINGLE
    for stage in range(where.pp):
        ranks = where.stage_ranks(stage)
        group = dist.new_group(ranks, backend=backend, timeout=tp_group.COLLECTIVE_TIMEOUT)
        steps = dist.new_group(ranks, backend="gloo", timeout=tp_group.COLLECTIVE_TIMEOUT)
        if stage == where.stage:
            mine = TPGroup(where.tp_rank, where.tp, group, steps)
    # gather_first's destination is global rank 0: only the last stage gathers logits
    assert where.stage != where.pp - 1 or where.rank - where.tp_rank == 0
    return mine


@dataclass(slots=True)
class StageIdle:
    """The pipeline's bubble as one rank sees it: the time it waited for its input (the
    previous stage's output; stage 0: rank 0's next batch) between its first batch and its
    last, over the batches it ran."""

    idle_s: float = 0.0
    batches: int = 0
    first: float | None = None  # when its first input arrived
    last: float = 0.0  # when its latest input arrived

    def record(self, start: float) -> None:
        """One blocking receive, begun at ``start`` (``perf_counter``), has just returned; the
        first is not idle (before it the rank had nothing to do: no pipeline yet)."""
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.idle_s += now - start
        self.last = now
        self.batches += 1

    @property
    def span_s(self) -> float:
        return 0.0 if self.first is None else self.last - self.first

    def describe(self, where: PipelineRank) -> str:
        share = self.idle_s / self.span_s if self.span_s else 0.0
        return (f"pipeline stage {where.stage} (rank {where.rank}): {self.batches} batches, "
                f"idle {self.idle_s:.3f}s of {self.span_s:.3f}s ({share:.1%})")


@dataclass(slots=True)
class StageLink:
    """One rank's ends of the pipeline: receives from ``where.prev``, sends to ``where.next``
    (rank 0: sends to all of stage 0, receives from the last-but-one stage)."""

    where: PipelineRank
    world: TPGroup  # every rank; its gloo step group carries the hand-offs
    hidden_size: int
    dtype: torch.dtype
    max_words: int  # ``payload_limit`` of this engine: a bigger announced step is refused
    _sending: list[Any] = field(default_factory=list)  # the isends in flight, with their data
    _submitted: deque[StepBatch] = field(default_factory=deque)  # rank 0: in flight, in order
    idle: StageIdle = field(default_factory=StageIdle)

    # -- rank 0 ---------------------------------------------------------------------------

    def submit(self, batch: StepBatch) -> None:
        """Rank 0: starts ``batch`` down the pipeline (it returns at once)."""
        self._wait_sends()
        payload = encode(batch)
        for dst in self.where.stage_ranks(0):
            self._send_batch(dst, _STEP, payload)
        self._submitted.append(batch)

    @property
    def oldest(self) -> StepBatch:
        return self._submitted[0]

    def submitted(self, batch: StepBatch) -> bool:
        return any(b is batch for b in self._submitted)

    def receive_output(self, batch: StepBatch) -> Any:
        """Rank 0: the last-but-one stage's output for ``batch``, the oldest submitted."""
        assert self._submitted and self._submitted[0] is batch, "batches return in order"
        self._submitted.popleft()
        start = time.perf_counter()
        out = self._receive_tensors(len(batch.input_ids))
        self.idle.record(start)
        return out

    @property
    def in_flight(self) -> int:
        return len(self._submitted)

    def stop(self) -> None:
        """Rank 0: tells every stage to leave its loop (after the batches in flight)."""
        self._wait_sends()
        for dst in self.where.stage_ranks(0):
            self._send_batch(dst, _STOP, np.zeros(0, np.int64))
        self._wait_sends()

    # -- the other ranks ------------------------------------------------------------------

    def receive(self) -> tuple[StepBatch, Any] | None:
        """The next step's batch and, after stage 0, the previous stage's output; None: stop."""
        header = torch.empty(2, dtype=torch.int64)
        start = time.perf_counter()
        dist.recv(header, self.where.prev, group=self.world.step_group)
        kind, length = header.tolist()
        if kind == _STOP:
            if self.where.next not in (None, 0):
                self._wait_sends()
                self._send_batch(self.where.next, _STOP, np.zeros(0, np.int64))
                self._wait_sends()
            return None
        self.idle.record(start)
        check_payload(length, self.max_words)  # before allocating what a peer announced
        payload = torch.empty(length, dtype=torch.int64)
        dist.recv(payload, self.where.prev, group=self.world.step_group)
        batch = decode(payload.numpy())
        if self.where.stage == 0:
            return batch, None
        return batch, self._receive_tensors(len(batch.input_ids))

    def send(self, batch: StepBatch, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Hands ``batch`` and this stage's output to the next stage's rank."""
        dst = self.where.next
        assert dst is not None
        self._wait_sends()
        if dst != 0:  # rank 0 has the batch
            self._send_batch(dst, _STEP, encode(batch))
        for t in (hidden, residual):
            t = t.contiguous().cpu()
            self._sending.append((dist.isend(t, dst, group=self.world.step_group), t))

    def close(self) -> None:
        self._wait_sends()

    # -- wire -----------------------------------------------------------------------------

    def _send_batch(self, dst: int, kind: int, payload: np.ndarray) -> None:
        header = torch.tensor([kind, len(payload)], dtype=torch.int64)
        self._sending.append((dist.isend(header, dst, group=self.world.step_group), header))
        if len(payload):
            data = torch.from_numpy(np.ascontiguousarray(payload, dtype=np.int64))
            self._sending.append((dist.isend(data, dst, group=self.world.step_group), data))

    def _receive_tensors(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for _ in range(2):
            t = torch.empty(num_tokens, self.hidden_size, dtype=self.dtype)
            dist.recv(t, self.where.prev, group=self.world.step_group)
            out.append(t)
        return out[0], out[1]

    def _wait_sends(self) -> None:
        for work, _ in self._sending:
            work.wait()
        self._sending.clear()
