"""One step's adapter layout, built once per step and read by every LoRA projection.

From each scheduled request's slot (-1: the base model) and its number of new tokens, one of:

* ``dense_slot``: every token of the step runs one adapter: each projection does two plain
  matmuls, nothing gathered;
* ``padded``: the rows under adapters grouped by slot, each slot's group padded to the
  longest (``width``; ``gather`` is ``[slots * width]``, padding rows repeat row 0): each
  projection gathers them once, does one batched matmul for every slot at once and one
  back, into rows whose last one is zero, then gathers each token's row of that (``scatter``:
  the zero row for base-model tokens) and adds it: five ops whatever the adapters;
* grouped: the rows under adapters grouped by slot, unpadded (``gather``, and ``groups``:
  (slot, start, end) into it), two matmuls per adapter in the step (at most ``max_loras``,
  never one per request), added back with one ``index_add_`` over those rows; for steps
  where padding would cost more than twice the rows (a long prompt beside decodes);
* for the Triton kernels, ``segments``: (first token, tokens, slot) per request under an
  adapter, on the device;
* ``stacked`` (CUDA graphs of decode steps): each token's slot (-1: the base model) in a static
  device buffer, and every projection runs every slot over every row, each row's other slots
  masked to zero: shapes fixed by the row count alone, so one captured graph serves any mix of
  adapters (``feature.LoRAFeature`` writes the slots before a replay).

A step with no adapter token gets no ``LoRAStep`` at all (``build`` returns None), and its
projections do nothing beyond reading that.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

DENSE, PADDED, GROUPED, SEGMENTS, STACKED = "dense", "padded", "grouped", "segments", "stacked"
_MAX_PADDING = 2.0  # padded rows per real row beyond which the grouped layout runs


@dataclass(slots=True)
class LoRAStep:
    kind: str  # DENSE, PADDED, GROUPED, SEGMENTS or STACKED
    dense_slot: int = -1  # DENSE: the slot every token runs
    # PADDED: [slots * width] rows (padding: row 0); GROUPED: [N] rows under an adapter,
    # grouped by slot
    gather: torch.Tensor | None = None
    # PADDED: [T] each token's row in that layout; base-model tokens: one past it (a zero row)
    scatter: torch.Tensor | None = None
    width: int = 0
    groups: tuple[tuple[int, int, int], ...] = ()  # GROUPED: (slot, start, end) into gather
    # SEGMENTS: [3, S] int32 (first token, tokens, slot) per request under an adapter, and
    # the longest such request (the kernels' grid).
    segments: torch.Tensor | None = None
    max_segment: int = 0
    # STACKED: [T] int64 each token's slot (-1: base model), a view of a static buffer
    token_slots: torch.Tensor | None = None


class LoRAState:
    """The field every LoRA projection of a model reads: the running step's layout (None for
    a step without adapters). Set once per step, on the thread that runs the model."""

    __slots__ = ("step",)

    def __init__(self) -> None:
        self.step: LoRAStep | None = None


def build(seq_slots: np.ndarray, query_lens: np.ndarray, num_slots: int,
          device: torch.device, segments: bool = False) -> LoRAStep | None:
    """The layout of a step whose request i has ``query_lens[i]`` new tokens under slot
    ``seq_slots[i]`` (of ``num_slots``); None when no request has an adapter."""
    active = seq_slots >= 0
    if not active.any():
        return None
    if segments:
        starts = np.cumsum(query_lens) - query_lens
        seg = np.stack([starts[active], query_lens[active], seq_slots[active]]).astype(np.int32)
        return LoRAStep(SEGMENTS, segments=torch.from_numpy(seg).to(device),
                        max_segment=int(query_lens[active].max()))
    first = int(seq_slots[0])
    if active.all() and (seq_slots == first).all():
        return LoRAStep(DENSE, dense_slot=first)
    token_slots = np.repeat(seq_slots, query_lens)
    rows = np.flatnonzero(token_slots >= 0)
    order = np.argsort(token_slots[rows], kind="stable")
    perm = rows[order]
    slots = token_slots[perm]
    counts = np.bincount(slots, minlength=num_slots)
    width = int(counts.max())
    if num_slots * width <= _MAX_PADDING * len(perm):
        return _padded(perm, counts, width, len(token_slots), device)
    bounds = np.flatnonzero(np.diff(slots)) + 1
    starts = np.concatenate(([0], bounds))
    ends = np.concatenate((bounds, [len(perm)]))
    groups = tuple((int(slots[s]), int(s), int(e)) for s, e in zip(starts, ends, strict=True))
    return LoRAStep(GROUPED, gather=torch.from_numpy(perm).to(device), groups=groups)


def _padded(perm: np.ndarray, counts: np.ndarray, width: int, num_tokens: int,
            device: torch.device) -> LoRAStep:
    """Slot s's rows at ``[s * width, s * width + counts[s])``; the rest pad (row 0)."""
    num_slots = len(counts)
    gather = np.zeros(num_slots * width, dtype=np.int64)
    within = (np.arange(width)[None, :] < counts[:, None]).reshape(-1)
    at = np.flatnonzero(within)
    gather[at] = perm  # perm is grouped by slot, in slot order
    scatter = np.full(num_tokens, num_slots * width, dtype=np.int64)  # the zero row
    scatter[perm] = at
    return LoRAStep(PADDED, gather=torch.from_numpy(gather).to(device),
                    scatter=torch.from_numpy(scatter).to(device), width=width)
