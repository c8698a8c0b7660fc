"""One pipeline stage of a model: a contiguous run of its decoder layers, and only their weights.

With ``pipeline_parallel_size`` P the layers are cut into P contiguous stages (``layer_ranges``,
vLLM's rule: an uneven remainder goes to the stages before the last, one layer each, since the
last also runs the norm and the LM head). Stage 0 holds the embedding, the last stage the final
norm and the LM head (and the embedding too when the head is tied to it: one weight for both).

A stage's model is built from the whole model on the meta device (``prune`` swaps what lives
on other stages for ``MissingLayer`` before any memory is allocated), loaded by name as usual
(the loader skips the checkpoint tensors of ``CausalLM.elsewhere``), and then keeps only its
own layers (``keep_local``), so its KV caches, its attention plan and its forward loop see
those alone. Between stages the residual stream travels as ``IntermediateTensors``: a stage
that is not the last returns the hidden states and the residual before the next layer's norm
adds them, so the next stage's first layer continues exactly where the previous one stopped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from services.engine.models.layers import CausalLM


@dataclass(frozen=True, slots=True)
class PipelineStage:
    """Stage ``index`` of ``size``: decoder layers ``[start, end)``."""

    index: int
    size: int
    start: int
    end: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    @property
    def num_layers(self) -> int:
        return self.end - self.start


@dataclass(slots=True)
class IntermediateTensors:
    """What one stage hands the next: the last layer's output and the residual stream before
    it (``[T, hidden]`` each; the next layer's input norm adds them)."""

    hidden: torch.Tensor
    residual: torch.Tensor


def layer_ranges(num_layers: int, size: int) -> list[tuple[int, int]]:
    """Each stage's ``[start, end)``: ``num_layers // size`` layers each, the remainder one
    more each on the stages before the last, from the second-to-last backwards."""
    if num_layers < size:
        raise ValueError(f"pipeline_parallel_size={size} exceeds the model's {num_layers} "
                         "layers (each stage needs one)")
    counts = [num_layers // size] * size
    for i in range(2, num_layers % size + 2):
        counts[-i] += 1
    ends = [sum(counts[: i + 1]) for i in range(size)]
    return [(end - n, end) for n, end in zip(counts, ends, strict=True)]


def stage_of(num_layers: int, index: int, size: int) -> PipelineStage:
    start, end = layer_ranges(num_layers, size)[index]
    return PipelineStage(index, size, start, end)


class MissingLayer(nn.Module):
    """What stands for a module another stage holds: no weights, never called."""

    def forward(self, *args: object) -> None:
        raise AssertionError("a module of another pipeline stage was called")


def prune(model: CausalLM, stage: PipelineStage) -> None:
    """Swaps every module another stage holds for a ``MissingLayer`` (on the meta device, before
    the weights are allocated) and records them in ``model.elsewhere`` for the loader."""
    inner = model.model
    gone = [f"model.layers.{i}." for i in range(len(inner.layers))
            if not stage.start <= i < stage.end]
    for i in range(len(inner.layers)):
        if not stage.start <= i < stage.end:
            inner.layers[i] = MissingLayer()
    tied = model.lm_head is inner.embed_tokens
    if not stage.is_first and not (stage.is_last and tied):
        inner.embed_tokens = MissingLayer()
        gone.append("model.embed_tokens.")
    if not stage.is_last:
        inner.norm = MissingLayer()
        model.lm_head = MissingLayer()
        gone += ["model.norm.", "lm_head."]
    model.elsewhere = tuple(gone)
    model.stage = stage


def keep_local(model: CausalLM, stage: PipelineStage) -> None:
    """After loading: the decoder holds this stage's layers only (its caches, plan and loop)."""
    inner = model.model
    inner.layers = nn.ModuleList(list(inner.layers)[stage.start : stage.end])
    assert not any(isinstance(m, MissingLayer) for m in inner.layers)


def stage_output(norm: nn.Module, hidden: torch.Tensor,
                 residual: torch.Tensor) -> torch.Tensor | IntermediateTensors:
    """The end of a decoder's forward: the final norm on the last stage, else what the next
    stage continues from."""
    if isinstance(norm, MissingLayer):
        return IntermediateTensors(hidden, residual)
    out, _ = norm(hidden, residual)
    return out


def warm_up_input(model: CausalLM, num_tokens: int) -> IntermediateTensors | None:
    """A stage after the first starts from hidden states, not token ids: zeros for warm-up."""
    if model.stage is None or model.stage.is_first:
        return None
    zeros = torch.zeros(num_tokens, model.config.hidden_size, dtype=model.compute_dtype)
    return IntermediateTensors(zeros, zeros.clone())
