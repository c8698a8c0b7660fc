"""The step's optional features behind one protocol: what the runner calls, in order.

A feature (the adapters' slots, grammar masks, speculative decoding, and the core's prompt
logprobs) is one object the runner holds while it is enabled; the runner loops over them at
fixed points of a step instead of branching per feature. Every hook has a no-op default, so a
feature overrides only the points it acts at. A part that imports the core builds its feature
through ``registry`` (a ``FeatureFactory``: what it needs before the KV pool is sized, then the
feature), so that the core names none of it. Lifecycle and threads::

    join / leave / move     engine thread, rank 0: a request takes a row of the input batch,
                            gives it back, or is moved by compaction (``InputBatch``)
    before_schedule         engine thread, rank 0: before each schedule, over the running
                            requests (it may set their ``num_lookahead_tokens``)
    lookahead_ids           engine thread, rank 0: the input ids a request's lookahead
                            tokens take in the step (the feature that set them holds them)
    needs_host_tokens       engine thread: the next step must wait for this one's tokens
    waits_after             engine thread, as a step starts: given that step's own state, the
                            next step must wait for its tokens
    prepare_rows            engine thread, rank 0: the step's rows gathered; writes what must
                            cross to the other ranks into the ``StepBatch``, returns the
                            feature's own state for this step (kept in ``PreparedStep.state``)
    host_inputs             the thread that builds a CPU step's tensors (engine thread under
                            async scheduling): per-step tensors built from the ``StepBatch``
    before_step             step thread, rank 0: with the step's state, before its batch
                            crosses to the other ranks and the model runs (it may write the
                            step's input ids: tokens a model of its own proposes)
    graph_key               step thread: this feature's part of the CUDA-graph key (None: no
                            part; ``EAGER``: the step cannot replay a graph)
    before_forward          step thread, every rank: just before the model runs eagerly
    before_replay           step thread: instead of ``before_forward`` when a CUDA graph of
                            this feature's part replays (the step written into static buffers)
    after_forward           step thread, every rank: the model ran (per-step state cleared)
    slice_scorer            rank 0: a callback for the logits of the hidden slices the feature
                            asked for in ``StepBatch.scored`` (prompt logprobs)
    whole_logits            rank 0: the step needs every sampled row's whole logits (no
                            sampling on tensor-parallel vocabulary shards)
    after_logits            rank 0: the sampled rows' logits, before sampling (masks)
    sample                  rank 0: the feature samples the step itself (a ``StepResult``;
                            None: the sampler does); at most one feature per step
    finish                  rank 0: after sampling, the feature's results into ``StepResult``
    applied                 engine thread, rank 0: the step's tokens were applied (the rows
                            of requests that finished already given back)
    stats                   engine thread: the feature's counters, as ``EngineStats`` fields
    graph_variants          before the engine serves: the graph-key parts this feature has
                            graphs of its own for (captured beside the base model's)
    capture_forward         inside a captured forward of such a graph, before the model: the
                            feature's static layout for that many rows (dummy adapters)
    warm_up                 before the engine serves, every rank: the feature's own model
                            path runs once (before the sampler's warm-up)
    warm_up_logits          before the engine serves, rank 0: the feature's logits path runs
                            once over ``logits`` (after the sampler's); ``compiling``: the
                            device compiles kernels on first use (a GPU)
    held_bytes              before the KV pool is sized: memory the feature holds (a feature
                            built before the pool; a ``FeatureFactory`` counts what its
                            feature will hold once built after it)

A feature's step state is built on the engine thread and read on the step thread: it must be
the step's own copy (gathered arrays), never a view of rows the next ``prepare`` rewrites.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from services.engine.parallel.step_broadcast import StepBatch

# The core's types, which this part may not import (the core imports it): named here for the
# signatures only.
Request = Any  # ``request.Request``
SchedulerOutput = Any  # ``scheduler.SchedulerOutput``
PreparedStep = Any  # ``model_runner.PreparedStep`` (its ``state``: each feature's step state)
StepResult = Any  # ``model_runner.StepResult``
ModelRunner = Any  # ``model_runner.ModelRunner``
InputBatch = Any  # ``input_batch.InputBatch``

# A graph-key part that keeps the step off the CUDA graphs (it runs eager).
EAGER = "eager"


@dataclass(slots=True)
class StepRows:
    """What ``prepare_rows`` sees of a step: its schedule, the batch that crosses to the other
    ranks, and the input-batch rows gathered (copies)."""

    sched: SchedulerOutput
    batch: StepBatch
    rows: np.ndarray  # every scheduled request's row, in schedule order
    query_lens: list[int]  # new tokens per scheduled request, in schedule order
    sampled_rows: np.ndarray  # the rows that sample, in logits order
    input_batch: InputBatch = None  # the rows' batch, for what a feature gathers itself


class StepFeature:
    """One optional feature of a step (see the module docstring); the defaults do nothing."""

    name: str = ""
    # Whether ``before_schedule`` may give running requests lookahead tokens (the scheduler
    # then reads every request's count each schedule).
    sets_lookahead: bool = False

    def join(self, req: Request, row: int) -> None:
        pass

    def leave(self, req: Request, row: int) -> None:
        pass

    def move(self, src: int, dst: int) -> None:
        pass

    def before_schedule(self, running: Sequence[Request]) -> None:
        pass

    def lookahead_ids(self, row: int, n: int) -> list[int] | None:
        return None

    def needs_host_tokens(self) -> bool:
        return False

    def waits_after(self, state: Any, num_rows: int) -> bool:
        return False

    def prepare_rows(self, rows: StepRows) -> Any:
        return None

    def before_step(self, state: Any, batch: StepBatch) -> None:
        pass

    def host_inputs(self, batch: StepBatch) -> Any:
        return None

    def graph_key(self, batch: StepBatch) -> Hashable | None:
        return None

    def before_forward(self, batch: StepBatch, host: Any) -> None:
        pass

    def before_replay(self, batch: StepBatch, num_rows: int) -> None:
        pass

    def after_forward(self) -> None:
        pass

    def graph_variants(self) -> list[Hashable]:
        return []

    def capture_forward(self, part: Hashable, num_rows: int) -> None:
        pass

    def slice_scorer(self, state: Any) -> Callable[[torch.Tensor], None] | None:
        return None

    def whole_logits(self, state: Any) -> bool:
        return False

    def after_logits(self, logits: torch.Tensor, state: Any, step: PreparedStep) -> None:
        pass

    def sample(self, logits: torch.Tensor, state: Any, step: PreparedStep) -> StepResult | None:
        return None

    def finish(self, state: Any, result: StepResult) -> None:
        pass

    def applied(self, sched: SchedulerOutput, result: StepResult) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {}

    def warm_up(self, runner: ModelRunner) -> list[str]:
        return []

    def warm_up_logits(
        self, runner: ModelRunner, logits: torch.Tensor, compiling: bool
    ) -> list[str]:
        return []

    def held_bytes(self, device: torch.device) -> int:
        return 0


class StepFeatures:
    """The enabled features, in the order the runner calls them (registration order)."""

    def __init__(self, features: Sequence[StepFeature] = ()) -> None:
        self.all: list[StepFeature] = []
        for f in features:
            self.add(f)

    def add(self, feature: StepFeature) -> None:
        assert feature.name and self.get(feature.name) is None, feature.name
        self.all.append(feature)

    def get(self, name: str) -> StepFeature | None:
        return next((f for f in self.all if f.name == name), None)

    def __iter__(self):
        return iter(self.all)

    def __bool__(self) -> bool:
        return bool(self.all)

    @property
    def sets_lookahead(self) -> bool:
        return any(f.sets_lookahead for f in self.all)

    # -- rows -------------------------------------------------------------------------------

    def join(self, req: Request, row: int) -> None:
        for f in self.all:
            f.join(req, row)

    def leave(self, req: Request, row: int) -> None:
        for f in self.all:
            f.leave(req, row)

    def move(self, src: int, dst: int) -> None:
        for f in self.all:
            f.move(src, dst)

    def before_schedule(self, running: Sequence[Request]) -> None:
        for f in self.all:
            f.before_schedule(running)

    def lookahead_ids(self, row: int, n: int) -> list[int]:
        """The input ids of ``row``'s ``n`` lookahead tokens: the feature that set them
        holds them."""
        for f in self.all:
            ids = f.lookahead_ids(row, n)
            if ids is not None:
                return ids
        raise AssertionError(f"row {row}: {n} lookahead tokens no feature holds")

    def needs_host_tokens(self) -> bool:
        return any(f.needs_host_tokens() for f in self.all)

    def waits_after(self, step: PreparedStep, num_rows: int) -> bool:
        """Whether the step after ``step`` must wait for its tokens, by the features' state
        for ``step`` (``num_rows``: the input batch's rows as ``step`` left them)."""
        return any(f.waits_after(step.state.get(f.name), num_rows) for f in self.all)

    # -- one step ---------------------------------------------------------------------------

    def prepare_rows(self, rows: StepRows) -> dict[str, Any]:
        """Each feature's state for the step (only the features that have one)."""
        out = {}
        for f in self.all:
            state = f.prepare_rows(rows)
            if state is not None:
                out[f.name] = state
        return out

    def before_step(self, step: PreparedStep) -> None:
        for f in self.all:
            f.before_step(step.state.get(f.name), step.batch)

    def host_inputs(self, batch: StepBatch) -> dict[str, Any]:
        out = {}
        for f in self.all:
            host = f.host_inputs(batch)
            if host is not None:
                out[f.name] = host
        return out

    def graph_key(self, batch: StepBatch) -> tuple[Hashable, ...] | None:
        """The features' parts of the step's graph key; None when one keeps it eager."""
        parts = []
        for f in self.all:
            part = f.graph_key(batch)
            if part == EAGER:
                return None
            if part is not None:
                parts.append(part)
        return tuple(parts)

    def before_forward(self, batch: StepBatch, host: dict[str, Any]) -> None:
        for f in self.all:
            f.before_forward(batch, host.get(f.name))

    def before_replay(self, batch: StepBatch, key: tuple[Hashable, ...], num_rows: int) -> None:
        """A graph of ``key`` replays: the features with a part in it fill their buffers,
        the others prepare as for an eager step (they have no per-step device state)."""
        for f in self.all:
            if f.graph_key(batch) in key:
                f.before_replay(batch, num_rows)
            else:
                f.before_forward(batch, None)

    def after_forward(self) -> None:
        for f in self.all:
            f.after_forward()

    def graph_variants(self) -> list[tuple[Hashable, ...]]:
        """The keys with graphs besides the base model's ``()``: one per feature part (a step
        whose key holds parts of two features has no graph: it runs eager)."""
        return [(part,) for f in self.all for part in f.graph_variants()]

    def capture_forward(self, key: tuple[Hashable, ...], num_rows: int) -> None:
        for f in self.all:
            for part in f.graph_variants():
                if part in key:
                    f.capture_forward(part, num_rows)

    def slice_scorer(self, state: dict[str, Any]) -> Callable[[torch.Tensor], None] | None:
        """The callback for ``StepBatch.scored``'s slices: at most one feature asks for them."""
        scorers = [s for f in self.all if (s := f.slice_scorer(state.get(f.name))) is not None]
        assert len(scorers) <= 1, "two features asked for hidden slices in one step"
        return scorers[0] if scorers else None

    def whole_logits(self, step: PreparedStep) -> bool:
        return any(f.whole_logits(step.state.get(f.name)) for f in self.all)

    def after_logits(self, logits: torch.Tensor, step: PreparedStep) -> None:
        for f in self.all:
            f.after_logits(logits, step.state.get(f.name), step)

    def sample(self, logits: torch.Tensor, step: PreparedStep) -> StepResult | None:
        """The step's result from the one feature that samples it itself (None: none does)."""
        for f in self.all:
            result = f.sample(logits, step.state.get(f.name), step)
            if result is not None:
                return result
        return None

    def finish(self, step: PreparedStep, result: StepResult) -> None:
        for f in self.all:
            f.finish(step.state.get(f.name), result)

    def applied(self, sched: SchedulerOutput, result: StepResult) -> None:
        for f in self.all:
            f.applied(sched, result)

    def stats(self) -> dict[str, Any]:
        """Every feature's counters, by ``EngineStats`` field."""
        out: dict[str, Any] = {}
        for f in self.all:
            out.update(f.stats())
        return out

    # -- before serving ---------------------------------------------------------------------

    def warm_up(self, runner: ModelRunner) -> list[str]:
        return [name for f in self.all for name in f.warm_up(runner)]

    def warm_up_logits(
        self, runner: ModelRunner, logits: torch.Tensor, compiling: bool
    ) -> list[str]:
        return [name for f in self.all for name in f.warm_up_logits(runner, logits, compiling)]

    def held_bytes(self, device: torch.device) -> dict[str, int]:
        return {f.name: f.held_bytes(device) for f in self.all}


class FeatureFactory:
    """An enabled feature's maker (``registry`` makes one per enabled feature, on every rank),
    called at three points of the runner's start:

    * ``before_packing``: every rank, once the model is loaded and before its weights are
      packed, for a feature that changes the model's layers (an adapter feature's slots read
      the weights' shapes); the feature it returns comes first in the step's order;
    * before the pool is sized: what the feature built after it needs (``lookahead_rows``,
      ``kv_bytes_per_token``, ``held_bytes``);
    * ``build``: the rank that prepares the steps (rank 0), after the pool, before the input
      batch: a feature that needs the pool's blocks (a model of its own keeps KV under the
      target's block ids), or the rank-0 side of one built before packing (None: nothing)."""

    name: str = ""

    def before_packing(self, runner: ModelRunner) -> StepFeature | None:
        return None

    def lookahead_rows(self) -> int:
        """Logits rows a sequence may take in one step besides its own token."""
        return 0

    def kv_bytes_per_token(self) -> int:
        """This rank's bytes of KV the feature keeps per token of the pool's blocks, beside the
        model's (the pool is sized for both)."""
        return 0

    def held_bytes(self) -> dict[str, int]:
        """Memory the built feature will hold, by item, held back from the KV pool's budget
        (it is allocated after the pool)."""
        return {}

    def build(self, runner: ModelRunner) -> StepFeature | None:
        return None
