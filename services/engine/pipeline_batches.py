"""Several steps in flight down a pipeline, so that its stages do not idle (vLLM's batch queue).

With P pipeline stages the engine keeps up to P scheduled steps (batches) in flight: while the
last stage (rank 0) finishes batch n, the stages before it already run n+1, and so on. Each
batch is scheduled from the requests that are in none of the batches in flight (a request is in
at most one: ``Scheduler.one_batch_per_request``), and takes at most its share of the
unfinished requests (``Scheduler.max_batch_seqs``: ceil(unfinished / P)), so that P batches
split a steady decode load between them instead of the first taking every request and the
others none. Batches finish in the order they were launched, and each is applied before the
next one is scheduled.

A schedule that preempts a request in flight: no further batch is launched until those in
flight are applied (the preempted request still awaits the token its batch samples and must
not be admitted again before it lands).

The bubble (what a stage idles) is measured by the stages themselves
(``parallel.pipeline.StageIdle``); this queue keeps the counts of what it launched.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from services.engine.model_runner import PreparedStep, StepResult
from services.engine.scheduler import Scheduler, SchedulerOutput

Applied = list[tuple[Any, list[Any]]]  # the engine's (request, logprobs) per request


class BatchQueue:
    """Up to ``depth`` steps in flight. ``schedule``, ``prepare``, ``launch``, ``run`` and
    ``apply`` are the engine's and the runner's own halves of a step."""

    def __init__(self, depth: int, scheduler: Scheduler,
                 schedule: Callable[[], SchedulerOutput],
                 prepare: Callable[[SchedulerOutput], PreparedStep],
                 launch: Callable[[PreparedStep], None],
                 run: Callable[[PreparedStep], StepResult],
                 apply: Callable[[SchedulerOutput, StepResult], Applied]) -> None:
        assert depth > 1
        self.depth, self.scheduler = depth, scheduler
        self._schedule, self._prepare, self._launch = schedule, prepare, launch
        self._run, self._apply = run, apply
        self.queue: deque[tuple[SchedulerOutput, PreparedStep]] = deque()
        self._draining = False  # a schedule preempted: launch nothing until the queue empties
        self.launched = 0
        self.peak = 0  # the most steps in flight at once
        scheduler.one_batch_per_request = True

    @property
    def in_flight(self) -> int:
        return len(self.queue)

    def step(self) -> Applied:
        """Fills the queue, then finishes and applies its oldest step."""
        while len(self.queue) < self.depth and not self._draining:
            sched = self._next_schedule()
            if sched.is_empty:
                break
            step = self._prepare(sched)
            self._launch(step)
            self.queue.append((sched, step))
            self.launched += 1
            self.peak = max(self.peak, len(self.queue))
            self._draining = bool(sched.preempted) and len(self.queue) > 1
        if not self.queue:
            return []
        sched, step = self.queue.popleft()
        if not self.queue:
            self._draining = False
        return self._apply(sched, self._run(step))

    def _next_schedule(self) -> SchedulerOutput:
        s = self.scheduler
        unfinished = len(s.running) + len(s.waiting)
        s.max_batch_seqs = max(1, -(-unfinished // self.depth))
        return self._schedule()
