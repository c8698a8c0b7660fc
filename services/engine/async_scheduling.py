"""Async scheduling (vLLM v1's ``--async-scheduling``): the host schedules and prepares step
n+1 while step n runs, so its work leaves the critical path.

The model half of a step (``ModelRunner.run``: forward, logits, sampling) runs on one worker
thread; torch releases the GIL inside its ops, so the engine's thread meanwhile schedules step
n+1 (assuming one token for each request step n samples for: a placeholder, see
``scheduler``), builds its batch, waits for step n, starts step n+1 with step n's sampled ids
(the placeholders' values, taken by index on the device), and only then applies step n's
output (stop checks, finishing, freeing blocks) and hands it to the caller (detokenization,
streaming), all while step n+1 runs.

A step falls back to synchronous stepping (step n applied before step n+1 is scheduled) when
``must_wait`` says so: the one place where what step n did meets what step n+1 will read.
Either way the step thread reads only what ``prepare`` gathered for its step, never a
request's live lists.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from services.engine.model_runner import ModelRunner, PreparedStep, StepResult
from services.engine.request import Request
from services.engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


def _use_device(device: torch.device) -> None:
    # A new thread starts on CUDA device 0: launch on the runner's ("cuda" alone means 0).
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def must_wait(step: PreparedStep, runner: ModelRunner) -> bool:
    """Whether the step after ``step`` must wait for ``step``'s tokens on the host (called as
    ``step`` starts, with the input batch as ``step`` left it): when its preparation or
    sampling reads what those tokens change (``InputBatch.needs_host_tokens``), or when a
    step feature says so from its state for ``step`` (``StepFeature.waits_after``: a verifier
    when ``step`` verified, or the next step may propose)."""
    ib = runner.input_batch
    if ib.needs_host_tokens():
        return True
    return runner.features.waits_after(step, ib.num_rows)


@dataclass(slots=True)
class InFlightStep:
    sched: SchedulerOutput
    future: Future[StepResult]
    # The next step must wait for this one to be applied (``must_wait``).
    needs_host: bool
    _rows: dict[Request, int] | None = None

    def sampled_rows(self) -> dict[Request, int]:
        """Each request this step samples for -> its row of the sampled ids."""
        if self._rows is None:
            self._rows = {req: i for i, req in enumerate(self.sched.sampling_requests())}
        return self._rows


class StepPipeline:
    """At most one step in flight, run by a worker thread: the thread that also built the
    model runner (``start``). On the CPU that matters: the model's math runs on OpenMP threads,
    and with a second team (the engine thread's, had it loaded and warmed up the model) next to
    the step thread's, libgomp, more threads than cores, stops spinning between parallel
    regions and each small GEMM pays a wake-up (a 135M model's steps took 28% longer)."""

    def __init__(self, device: torch.device) -> None:
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix="engine-step", initializer=_use_device, initargs=(device,))
        self.runner: ModelRunner | None = None
        self.in_flight: InFlightStep | None = None

    def start(self, make_runner: Callable[[], ModelRunner]) -> ModelRunner:
        """Builds the runner on the step thread; returns it."""
        try:
            self.runner = self._pool.submit(make_runner).result()
        except BaseException:
            self._pool.shutdown(wait=True)
            raise
        return self.runner

    def launch(
        self, sched: SchedulerOutput, step: PreparedStep, after: StepResult | None = None
    ) -> None:
        """Starts ``step``; ``after``: the result of the step it follows, whose sampled ids
        fill its placeholders."""
        assert self.in_flight is None
        tokens = None if after is None else after.sampler_output.token_tensor
        future = self._pool.submit(self.runner.run, step, tokens)
        self.in_flight = InFlightStep(sched, future, must_wait(step, self.runner))

    def wait(self) -> tuple[SchedulerOutput, StepResult]:
        """The step in flight, finished (its exception, if it failed); nothing is in flight
        after."""
        step, self.in_flight = self.in_flight, None
        assert step is not None
        return step.sched, step.future.result()

    def drain(self) -> None:
        """Waits out a step in flight and forgets it (after a failure: its output is lost)."""
        step, self.in_flight = self.in_flight, None
        if step is not None:
            try:
                step.future.result()
            except Exception:
                logger.debug("the step in flight failed too", exc_info=True)

    def close(self) -> None:
        self.drain()
        self._pool.shutdown(wait=True)
