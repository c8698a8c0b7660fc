"""vLLM's profiling run: the largest step run once before the KV pool is sized, its peak memory
measured, so the pool leaves exactly that to the steps (``FeatureMemory.step_peak``) instead of
an estimate from the model's shapes.

The run, on every rank (its collectives meet), on a scratch pool of just the blocks it writes
(allocated before measuring, so not counted, and freed after):

    forward   ``max_num_batched_tokens`` prompt tokens in one sequence (at most the model's
              context: the same tokens in more sequences hold no more), then each step
              feature's own path (``StepFeature.warm_up``: an adapter feature's layout)
    logits    the most rows a step samples (``max_num_seqs`` x the rows a sequence may take)
    sampler   over those rows, greedy and with every sampling feature at once

Measured by ``CudaPeak`` on a GPU (the caching allocator's peak) and by ``TensorPeak``
elsewhere (the storages that torch operations create: memory that a C++ kernel outside the
dispatcher allocates and frees inside itself is not seen, so on the CPU the figure is a floor).

Off unless ``PAGODA_PROFILE_RUN=1``: it has run on a GPU once (an H200, 2026-12-04, a small
model, where it agreed with the shapes' count), not yet where the two differ; it is meant to
be the GPU default once it has; without it the items are counted from shapes
(``memory_budget``).
Pipeline stages are not profiled (their forward crosses stages): they count from shapes.
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from services.engine.feature_warm_up import run_sampler, warm_up_forward

if TYPE_CHECKING:
    from services.engine.model_runner import ModelRunner

PROFILE_RUN_ENV = "PAGODA_PROFILE_RUN"


def enabled() -> bool:
    return os.environ.get(PROFILE_RUN_ENV) == "1"


class PeakMeter(Protocol):
    """A context whose ``peak`` is, after it exits, the most bytes allocated inside it at once
    beyond what was allocated when it entered."""

    peak: int

    def __enter__(self) -> PeakMeter: ...

    def __exit__(self, *exc: object) -> None: ...


class CudaPeak:
    """The caching allocator's peak on ``device`` (all of torch's allocations there)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.peak, self._base = device, 0, 0

    def __enter__(self) -> CudaPeak:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize(self.device)
        self.peak = torch.cuda.max_memory_allocated(self.device) - self._base


class TensorPeak(TorchDispatchMode):
    """Counts the storages that torch operations create while it is active: a storage is new
    when an operation's output lies in none of its inputs' storages, and is freed when the last
    tensor seen on it dies. Storages made before it entered are never counted."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0
        self._now = 0
        self._live: dict[int, list[int]] = {}  # data_ptr -> [bytes, tensors seen on it]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        inputs = {_ptr(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self._seen(t, inputs)
        return out

    def _seen(self, t: torch.Tensor, inputs: set[int]) -> None:
        ptr = _ptr(t)
        entry = self._live.get(ptr)
        if entry is None:
            if ptr in inputs or not ptr:  # an in-place result or a view of an input
                return
            entry = self._live[ptr] = [t.untyped_storage().nbytes(), 0]
            self._now += entry[0]
            self.peak = max(self.peak, self._now)
        entry[1] += 1
        weakref.finalize(t, self._dropped, ptr)

    def _dropped(self, ptr: int) -> None:
        entry = self._live[ptr]
        entry[1] -= 1
        if not entry[1]:
            del self._live[ptr]
            self._now -= entry[0]


def _ptr(t: torch.Tensor) -> int:
    """Its storage's address; 0 for a tensor without one (oneDNN's packed weights)."""
    try:
        return t.untyped_storage().data_ptr()
    except NotImplementedError:
        return 0


def meter_for(device: torch.device) -> PeakMeter:
    return CudaPeak(device) if device.type == "cuda" else TensorPeak()


@torch.inference_mode()
def largest_step_peak(runner: ModelRunner) -> int:
    """The profiling run (module docstring) on ``runner`` before its pool exists; returns the
    peak bytes it allocated beyond the scratch pool."""
    c, bs = runner.config, runner.block_size
    # One sequence: as long as the step, within the context a sequence may have.
    context = c.max_model_len or runner.model_config.max_position_embeddings
    n = min(c.max_num_batched_tokens, context)
    scratch = runner._allocate_kv_caches(-(-n // bs))
    runner.kv_caches, runner.num_blocks = scratch, len(scratch[0][0])
    rows = c.max_num_seqs * runner.rows_per_seq
    try:
        with meter_for(runner.device) as meter:
            hidden = warm_up_forward(runner, n)
            runner.features.warm_up(runner)
            if isinstance(hidden, torch.Tensor):  # (a pipeline's stages are not profiled)
                # Every rank: the logits' gather is a collective; rank 0 gets them.
                logits = runner.model.compute_logits(hidden[torch.arange(rows) % n])
                if logits is not None:
                    run_sampler(runner, logits)  # greedy, then every sampling feature
                del logits
            del hidden
    finally:
        runner.num_blocks = 0
        del scratch  # the last reference besides the runner's: its blocks can go back
        runner.release_kv_pool()
    return meter.peak
