"""A step's integer inputs, staged in pinned host memory and sent to the device in ONE copy.

Per step the runner needs token ids, positions, KV slots, the rows to take logits from, the
query/key boundaries, context lengths and block tables. Built as separate tensors that is
seven synchronous host-to-device copies; here they are packed into one pinned byte buffer,
sent with a single ``non_blocking`` copy, and read on the device as typed views::

    bytes:  | input_ids | positions | slot_mapping | logits_rows | cu_q | cu_k | ctx | tables |
    dtype:    int64       int64       int64          int64         int32  int32  int32  int32

Each segment starts on a 16-byte boundary (Triton specialises pointers on that). An eager
step packs the segments tightly for its own sizes. A CUDA-graph step (decode only) uses the
fixed ``decode`` layout, each segment sized for ``max_num_seqs``, so a captured graph finds
its inputs at the same addresses every replay; its block tables go on to a persistent
``[max_num_seqs, max_blocks_per_seq]`` table (one device-side copy), whose row stride the
graph captured. Rows past the real requests are padding: token 0, position 0, slot -1 (writes
no KV), context length 1 (reads one cached key of some block, a finite value).

Two host buffers alternate, each with a CUDA event recorded after its copy: the host fills one
while the device may still be reading the other (so preparing step n+1 never waits on step n).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.engine.attention.base import AttentionMetadata
from services.engine.attention.metadata import HostStep, plan_step

_ALIGN = 16
_SEGMENTS = (  # name, numpy dtype, which count sizes it
    ("input_ids", np.int64, "tokens"),
    ("positions", np.int64, "tokens"),
    ("slot_mapping", np.int64, "tokens"),
    ("logits_rows", np.int64, "tokens"),  # one per request, or more in a verified step
    ("cu_seqlens_q", np.int32, "seqs+1"),
    ("cu_seqlens_k", np.int32, "seqs+1"),
    ("context_lens", np.int32, "seqs"),
)
_TORCH_DTYPES = {np.int64: torch.int64, np.int32: torch.int32}


@dataclass(frozen=True, slots=True)
class Layout:
    """Byte offsets of each segment; ``tables`` is last, ``[rows, width]`` int32."""

    offsets: dict[str, int]
    tables: int
    rows: int
    width: int

    @property
    def nbytes(self) -> int:
        return self.tables + self.rows * self.width * 4


def make_layout(num_tokens: int, num_seqs: int, width: int) -> Layout:
    """Segments for ``num_tokens`` tokens and ``num_seqs`` requests, tables ``width`` wide."""
    counts = {"tokens": num_tokens, "seqs": num_seqs, "seqs+1": num_seqs + 1}
    offsets, at = {}, 0
    for name, dtype, count in _SEGMENTS:
        offsets[name] = at
        at += _aligned(counts[count] * np.dtype(dtype).itemsize)
    return Layout(offsets=offsets, tables=at, rows=num_seqs, width=width)


@dataclass(slots=True)
class StagedStep:
    """A step's inputs on the device. ``meta`` and the tensors cover the real requests only
    (padding rows, if any, sit past them in the same buffers)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    logits_rows: torch.Tensor  # [R] int64: hidden-state rows that get logits
    meta: AttentionMetadata


class StepBuffers:
    """Pinned host staging and one device buffer for the steps of one model runner."""

    def __init__(
        self,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self.decode_layout = make_layout(max_num_seqs, max_num_seqs, max_blocks_per_seq)
        eager = make_layout(max_num_tokens, max_num_seqs, max_blocks_per_seq)
        nbytes = max(eager.nbytes, self.decode_layout.nbytes)
        pin = device.type == "cuda"
        self._host = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self._copied = [torch.cuda.Event() if pin else None for _ in range(2)]
        self._turn = 0
        self.device_bytes = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        # What CUDA graphs read: the decode layout's segments, and a table of fixed stride.
        self.graph_tables = torch.zeros(
            (max_num_seqs, max_blocks_per_seq), dtype=torch.int32, device=device
        )

    # -- staging ----------------------------------------------------------------------------

    def fits(self, num_tokens: int, num_seqs: int, width: int) -> bool:
        """Whether an eager step of these sizes fits the buffers."""
        return (num_seqs <= self.max_num_seqs and width <= self.max_blocks_per_seq
                and make_layout(num_tokens, num_seqs, width).nbytes <= self.device_bytes.numel())

    def stage(
        self,
        input_ids: np.ndarray,
        block_tables: np.ndarray,
        num_blocks: np.ndarray,
        seq_lens: np.ndarray,
        query_lens: np.ndarray,
        logits_rows: np.ndarray,
        pad_to: int | None = None,
    ) -> StagedStep:
        """Packs one step (``metadata.plan_step``'s arguments, the token ids and the logits
        rows) and sends it. ``pad_to`` (decode steps only) selects the graph layout and fills
        rows ``len(seq_lens) .. pad_to`` with padding."""
        num_seqs, num_tokens = len(seq_lens), len(input_ids)
        width = block_tables.shape[1]
        if pad_to is None:
            layout = make_layout(num_tokens, num_seqs, width)
        else:
            assert num_tokens == num_seqs <= pad_to <= self.max_num_seqs, "decode steps only"
            layout = make_layout(self.max_num_seqs, self.max_num_seqs, self.max_blocks_per_seq)
            layout = Layout(layout.offsets, layout.tables, num_seqs, width)
        step = plan_step(block_tables, num_blocks, seq_lens, query_lens, self.block_size)
        host = self._next_host()
        views = _numpy_views(host.numpy(), layout)
        views["tables"][:] = step.block_tables
        _fill(views, step, input_ids, logits_rows)
        if pad_to is not None:
            _pad(views, num_seqs, pad_to)
        self._send(host, layout.nbytes)
        staged = self._staged(layout, step, num_tokens, len(logits_rows))
        if pad_to is not None:
            # The graphs read a table of fixed stride: scatter this step's rows into it.
            self.graph_tables[:num_seqs, :width].copy_(staged.meta.block_tables)
        return staged

    def stage_padding(self, num_rows: int) -> None:
        """Graph layout, every row padding (graph capture and warm-up)."""
        layout = self.decode_layout
        host = self._next_host()
        views = _numpy_views(host.numpy(), layout)
        views["cu_seqlens_q"][0] = views["cu_seqlens_k"][0] = 0
        _pad(views, 0, num_rows)
        self._send(host, layout.tables)

    def graph_inputs(self, num_rows: int, decode_num_splits: int) -> StagedStep:
        """The fixed views a decode graph of ``num_rows`` rows is captured over."""
        d = self._device_views(self.decode_layout, num_rows, num_rows)
        meta = AttentionMetadata(
            slot_mapping=d["slot_mapping"],
            cu_seqlens_q=d["cu_seqlens_q"],
            cu_seqlens_k=d["cu_seqlens_k"],
            context_lens=d["context_lens"],
            block_tables=self.graph_tables[:num_rows],
            max_seqlen_q=1,
            max_seqlen_k=self.max_blocks_per_seq * self.block_size,
            query_lens=[1] * num_rows,
            seq_lens=[1] * num_rows,
            block_size=self.block_size,
            decode_num_splits=decode_num_splits,
        )
        return StagedStep(d["input_ids"], d["positions"], d["logits_rows"], meta)

    # -- internals --------------------------------------------------------------------------

    def _next_host(self) -> torch.Tensor:
        self._turn ^= 1
        event = self._copied[self._turn]
        if event is not None:
            event.synchronize()  # the copy that last read this buffer has finished
        return self._host[self._turn]

    def _send(self, host: torch.Tensor, nbytes: int) -> None:
        self.device_bytes[:nbytes].copy_(host[:nbytes], non_blocking=True)
        event = self._copied[self._turn]
        if event is not None:
            event.record()

    def _device_views(self, layout: Layout, num_tokens: int, num_seqs: int) -> dict:
        views = {}
        for name, dtype, count in _SEGMENTS:
            n = {"tokens": num_tokens, "seqs": num_seqs, "seqs+1": num_seqs + 1}[count]
            start = layout.offsets[name]
            size = n * np.dtype(dtype).itemsize
            views[name] = self.device_bytes[start : start + size].view(_TORCH_DTYPES[dtype])
        return views

    def _staged(
        self, layout: Layout, step: HostStep, num_tokens: int, num_logits: int
    ) -> StagedStep:
        d = self._device_views(layout, num_tokens, layout.rows)
        size = layout.rows * layout.width * 4
        tables = self.device_bytes[layout.tables : layout.tables + size].view(torch.int32)
        meta = AttentionMetadata(
            slot_mapping=d["slot_mapping"],
            cu_seqlens_q=d["cu_seqlens_q"],
            cu_seqlens_k=d["cu_seqlens_k"],
            context_lens=d["context_lens"],
            block_tables=tables.view(layout.rows, layout.width),
            max_seqlen_q=step.max_seqlen_q,
            max_seqlen_k=step.max_seqlen_k,
            query_lens=step.query_lens,
            seq_lens=step.seq_lens,
            block_size=self.block_size,
        )
        return StagedStep(d["input_ids"], d["positions"], d["logits_rows"][:num_logits], meta)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _numpy_views(buf: np.ndarray, layout: Layout) -> dict[str, np.ndarray]:
    """Whole-segment numpy views of a host buffer (writes land in the pinned memory)."""
    views = {}
    ends = [*(layout.offsets[n] for n, _, _ in _SEGMENTS[1:]), layout.tables]
    for (name, dtype, _), end in zip(_SEGMENTS, ends, strict=True):
        views[name] = buf[layout.offsets[name] : end].view(dtype)
    size = layout.rows * layout.width * 4
    views["tables"] = buf[layout.tables : layout.tables + size].view(np.int32).reshape(
        layout.rows, layout.width
    )
    return views


def _fill(
    views: dict[str, np.ndarray],
    step: HostStep,
    input_ids: np.ndarray,
    logits_rows: np.ndarray,
) -> None:
    t, s = len(step.positions), len(step.context_lens)
    views["input_ids"][:t] = input_ids
    views["positions"][:t] = step.positions
    views["slot_mapping"][:t] = step.slot_mapping
    views["logits_rows"][: len(logits_rows)] = logits_rows
    views["cu_seqlens_q"][: s + 1] = step.cu_seqlens_q
    views["cu_seqlens_k"][: s + 1] = step.cu_seqlens_k
    views["context_lens"][:s] = step.context_lens


def _pad(views: dict[str, np.ndarray], start: int, stop: int) -> None:
    """Rows ``start .. stop`` of a decode layout become padding (one token each, no KV write,
    a context of one key)."""
    if stop <= start:
        return
    views["input_ids"][start:stop] = 0
    views["positions"][start:stop] = 0
    views["slot_mapping"][start:stop] = -1
    views["context_lens"][start:stop] = 1
    extra = np.arange(1, stop - start + 1, dtype=np.int32)
    views["cu_seqlens_q"][start + 1 : stop + 1] = views["cu_seqlens_q"][start] + extra
    views["cu_seqlens_k"][start + 1 : stop + 1] = views["cu_seqlens_k"][start] + extra
