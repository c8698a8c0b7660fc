"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed over fixed buffers.

A decode step launches a few hundred small kernels; on a fast GPU launching them costs more than
running them. So the runner captures the model's forward once per bucket of batch sizes
(1, 2, 4, then steps of 8 up to ``max_num_seqs``, as vLLM) over the fixed views
``StepBuffers.graph_inputs`` hands out, and replays the graph of the smallest bucket that
holds a step, the rows past its requests padded (``step_buffers``). Prefill and mixed steps
run eagerly. ``--enforce-eager`` turns graphs off.

The decode kernel cannot plan its context split from a step's longest context inside a graph
(the launch is frozen), so each bucket fixes a split count from its batch size and the longest
context the engine allows; the kernel sizes the splits from each sequence's own length.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from services.engine.step_buffers import StepBuffers

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, object], torch.Tensor]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch-size buckets: 1, 2, 4, then multiples of 8, and ``max_num_seqs`` itself."""
    sizes = {s for s in (1, 2, 4) if s <= max_num_seqs}
    sizes.update(range(8, max_num_seqs + 1, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def bucket_for(sizes: list[int], num_seqs: int) -> int | None:
    """The smallest bucket holding ``num_seqs`` rows (None past the largest)."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    """Captured decode forwards keyed by bucket; ``replay(n)`` runs the bucket that holds n."""

    def __init__(
        self,
        forward: Forward,
        buffers: StepBuffers,
        sizes: list[int],
        num_splits: Callable[[int], int],
    ) -> None:
        self.sizes = sizes
        self._forward = forward
        self._buffers = buffers
        self._num_splits = num_splits
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def bucket(self, num_seqs: int) -> int | None:
        return bucket_for(self.sizes, num_seqs)

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket, largest first (later, smaller graphs reuse its memory pool).
        Each bucket runs once eagerly first, so Triton compiles outside the capture."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            inputs = self._buffers.graph_inputs(size, self._num_splits(size))
            self._buffers.stage_padding(size)
            self._forward(inputs.input_ids, inputs.positions, inputs.meta)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(inputs.input_ids, inputs.positions, inputs.meta)
            self._graphs[size] = (graph, hidden)
        torch.cuda.synchronize()
        logger.info("captured %d decode graphs (batch 1..%d) in %.1fs",
                    len(self.sizes), self.sizes[-1], time.perf_counter() - start)

    def replay(self, size: int) -> torch.Tensor:
        """Runs bucket ``size`` over what ``StepBuffers.stage(..., pad_to=size)`` staged;
        returns its hidden states ``[size, hidden]`` (valid until the next replay)."""
        graph, hidden = self._graphs[size]
        graph.replay()
        return hidden
