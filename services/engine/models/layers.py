"""Building blocks shared by the decoder architectures, and the CausalLM base the runner sees.

Parameters are created with ``requires_grad=False``: this is an inference engine, and autograd
bookkeeping would only slow the CPU hot path down if a caller forgot ``inference_mode``.

Layers that have a kernel (norms, the activation, RoPE, the experts) call ``self.kernels``, one
``LayerKernels`` for the model's device and dtype that the loader binds once
(``CausalLM.use_kernels``); their forward checks nothing about the device per call.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.attention.base import AttentionMetadata
from services.engine.models.layer_kernels import LayerKernels, torch_kernels
from services.engine.models.onednn import PackedWeight
from services.engine.models.unquantized_linear import UNQUANTIZED
from services.engine.quantization.base import LinearMethod

if TYPE_CHECKING:
    from services.engine.models.config import ModelConfig, RopeConfig
    from services.engine.models.pipeline_stage import IntermediateTensors, PipelineStage

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each [blocks, bs, kv_heads, d]


def empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised frozen parameter (the loader fills it)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class CausalLM(nn.Module):
    """What the model runner calls: a decoder over a flattened batch, plus the LM head."""

    config: ModelConfig
    # Pipeline parallelism (``pipeline_stage``): the stage this model is, and the checkpoint
    # name prefixes of the modules other stages hold (the loader skips them).
    stage: PipelineStage | None = None
    elsewhere: tuple[str, ...] = ()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """The final hidden states; a pipeline stage starts from ``intermediate`` (all but
        the first) and, unless it is the last, returns what the next stage continues from."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def plan_attention(self, meta: AttentionMetadata) -> None:
        """Sets ``meta.plan``: the step's attention plan, built once for every layer."""
        raise NotImplementedError

    def stacked_params(self) -> dict[str, tuple[str, ...]]:
        """Fused module name -> the HF module names stacked into it, in order."""
        return {}

    def reset_buffers(self) -> None:
        """Recomputes non-persistent buffers (after ``to_empty`` from the meta device)."""

    def checkpoint_name(self, name: str) -> str:
        """The name a checkpoint tensor has in our layout (e.g. Mixtral's block_sparse_moe)."""
        return name

    def after_load(self) -> None:
        """Adjusts loaded weights once, before the model runs (e.g. Gemma's 1 + norm weight)."""

    def limit_context(self, max_model_len: int) -> None:
        """The engine serves at most ``max_model_len`` tokens per sequence (Phi-3's longrope
        picks its factors by it)."""

    def pack_weights(self) -> None:
        """Packs every projection for oneDNN (CPU); a no-op where packing does not apply."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()

    def use_kernels(self, kernels: LayerKernels) -> None:
        """Binds every layer to ``kernels`` (``layer_kernels.select_kernels`` for the model's
        device and dtype); the loader calls it once, with the weights on their device."""
        for module in self.modules():
            if isinstance(module, UsesKernels):
                module.use_kernels(kernels)


class UsesKernels(nn.Module):
    """A layer whose forward calls ``self.kernels``: torch's for its dtype (any device) until
    ``CausalLM.use_kernels`` binds the ones chosen for the model."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.kernels = torch_kernels(dtype)

    def use_kernels(self, kernels: LayerKernels) -> None:
        self.kernels = kernels


# --------------------------------------------------------------------------- RMSNorm


class RMSNorm(UsesKernels):
    """RMSNorm with an optional fused residual add.

    ``norm(x)`` returns the normalised x; ``norm(x, residual)`` adds x into ``residual`` IN
    PLACE and returns ``(normalised(residual), residual)``, so decoder layers carry the
    residual stream without an extra pass or allocation. x is ``[T, hidden]``.
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(dtype)
        self.eps = eps
        self.weight = empty_param(size, dtype=dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)


class HeadRMSNorm(nn.Module):
    """Per-head RMSNorm over head_dim with one weight row per head (Qwen3's q_norm/k_norm).

    Q and K heads are normalised together in one pass: rows ``[0, num_q_heads)`` hold q_norm's
    weight, the rest k_norm's (the loader broadcasts each HF vector into its rows).
    """

    def __init__(
        self, num_q_heads: int, num_kv_heads: int, head_dim: int, eps: float, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_param(num_q_heads + num_kv_heads, head_dim, dtype=dtype)
        self.shard_sizes = (num_q_heads, num_kv_heads)
        self.upcast = dtype != torch.float32  # statistics in float32, as HF

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, q_heads + kv_heads, head_dim]
        if self.upcast:
            return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), None, self.eps) * self.weight


# --------------------------------------------------------------------------- Linear


class Linear(nn.Module):
    """``y = x W^T + b``; a fused projection records the sizes of the weights stacked in it.

    How the weight is held and applied is the layer's ``method`` (``quantization.base``): the
    unquantized one unless the loader hands it a checkpoint scheme's (``use_method``, on the meta
    device, before the weights are read). On the CPU the runner calls ``pack()`` once the
    weights are loaded: an unquantized weight moves into oneDNN's blocked layout (``onednn``)
    and the plain copy is dropped.

    ``addend``: another contribution to the output, set from outside the model (an adapter
    part's slots on the projections it targets): ``addend(x, y)`` adds its products of ``x`` to
    the output ``y`` (in place) and returns it. None everywhere else.
    """

    addend: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    method: LinearMethod = UNQUANTIZED

    def __init__(
        self,
        in_features: int,
        shard_sizes: tuple[int, ...],
        bias: bool,
        dtype: torch.dtype,
        quantizable: bool = True,
        full_in_features: int | None = None,
    ) -> None:
        super().__init__()
        self.quantizable = quantizable  # False: unquantized whatever the scheme (MoE routers)
        self.shard_sizes = shard_sizes  # rows of each stacked HF weight, in order
        self.in_features = in_features  # this rank's
        # every rank's together (a row-parallel layer's differ): a scheme whose groups run
        # along the inputs sizes them from it
        self.full_in_features = full_in_features or in_features
        self.out_features = sum(shard_sizes)  # this rank's
        self.has_bias = bias
        self.dtype = dtype  # of the activations (and of an unquantized weight)
        self.packed: PackedWeight | None = None
        self.method.create_weights(self)

    def use_method(self, method: LinearMethod) -> None:
        """Holds the weight as ``method`` says (replacing the unquantized parameters)."""
        for leaf in list(self._parameters):
            delattr(self, leaf)
        self.__dict__.pop("bias", None)  # a layer without one holds a plain None
        self.method = method
        method.create_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x, self.bias)
        return y if self.addend is None else self.addend(x, y)

    def pack(self) -> None:
        self.method.pack(self)


class Embedding(nn.Module):
    """Token embedding table; also the LM head when embeddings are tied."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_param(vocab_size, hidden_size, dtype=dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


# --------------------------------------------------------------------------- RoPE


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies (float32, [head_dim // 2]) for the configured rope type."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    if rope.rope_type == "longrope":
        raise ValueError("longrope needs its own table (models.phi3.LongRopeEmbedding)")
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by ``factor``, short ones kept, and a
    smooth interpolation between the two bands."""
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(UsesKernels):
    """A cos/sin table for every position up to ``max_positions``, computed once.

    ``cos_sin[p, 0]`` is ``cos(p * f)`` over the full head_dim (the half-frequencies repeated);
    ``cos_sin[p, 1]`` is ``sin(p * f)`` with its first half negated, so that rotating is
    ``x * cos + roll(x, d/2) * signed_sin`` (see ``apply_rotary``): four torch ops per call, or
    one in-place pass of the bound kernel (the CPU kernel, or on CUDA the Triton kernel).
    """

    def __init__(
        self, head_dim: int, max_positions: int, rope: RopeConfig, dtype: torch.dtype
    ) -> None:
        super().__init__(dtype)
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.rope = rope
        self.register_buffer(
            "cos_sin", torch.empty(max_positions, 2, head_dim, dtype=dtype), persistent=False
        )
        self.reset_cache()

    def reset_cache(self) -> None:
        if self.cos_sin.is_meta:
            return  # filled after the model is materialised on its device
        inv_freq = rope_inv_freq(self.head_dim, self.rope)
        self.cos_sin.copy_(cos_sin_table(inv_freq, self.max_positions, self.cos_sin.device))

    def forward(self, positions: torch.Tensor) -> RopeStep:
        """The rotation of one step's tokens (shared by every layer of the step)."""
        rotate = self.kernels.rotary
        if rotate is not None:
            # The kernel reads the table in place: no gather, nothing step-dependent on the
            # host (CUDA-graph safe).
            return RopeStep(positions, self.cos_sin, kernel=rotate)
        cs = self.cos_sin.index_select(0, positions)
        return RopeStep(positions, self.cos_sin, cs[:, 0:1], cs[:, 1:2])


def cos_sin_table(
    inv_freq: torch.Tensor, num_positions: int, device: torch.device, scale: float = 1.0
) -> torch.Tensor:
    """``[num_positions, 2, head_dim]``: cos and signed sin (``RotaryEmbedding``'s layout),
    times ``scale`` (longrope's attention factor), computed in float32 as the HF reference."""
    positions = torch.arange(num_positions, device=device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.to(device)[None, :]
    cos, sin = freqs.cos() * scale, freqs.sin() * scale
    return torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), dim=1)


@dataclass(frozen=True, slots=True)
class RopeStep:
    positions: torch.Tensor  # [T] int64 (int32 also taken on CUDA)
    table: torch.Tensor  # RotaryEmbedding.cos_sin
    cos: torch.Tensor | None = None  # [T, 1, head_dim], gathered for the torch path
    signed_sin: torch.Tensor | None = None
    # The bound in-place kernel (LayerKernels.rotary); None: the torch path over cos/signed_sin.
    kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None


def apply_rotary(x: torch.Tensor, rope: RopeStep) -> torch.Tensor:
    """Rotate-half RoPE on ``x`` ``[T, heads, head_dim]``: in place by the step's kernel when it
    has one, else a new tensor. Either way the rotated tensor is returned.

    ``roll`` by d/2 gives ``[x2, x1]``; times ``[-sin, sin]`` that is HF's ``rotate_half(x) * sin``.
    Multiply and add stay separate ops (not ``addcmul``): a fused multiply-add rounds once
    instead of twice, and that alone moved SmolLM2's logits by ~7e-5 away from the reference.
    """
    if rope.kernel is not None:
        return rope.kernel(x, rope.table, rope.positions)
    rolled = torch.roll(x, x.shape[-1] // 2, dims=-1).mul_(rope.signed_sin)
    return (x * rope.cos).add_(rolled)
