"""compressed-tensors checkpoints (llm-compressor's output): which layer gets which method.

``quantization_config`` (``quant_method: compressed-tensors``) lists ``config_groups``, each
with ``targets`` (``"Linear"``, a module name, or ``"re:<regex>"``), the ``weights`` and
``input_activations`` arguments, and a global ``ignore`` list in the same syntax. A layer is
matched by its checkpoint module names; a fused projection's sources must all get the same
scheme. Schemes served: ``W8A8Int8Method`` (``int-quantized``: channel int8 weights, dynamic
per-token int8 activations) and ``FP8W8A16Method`` (``float-quantized``: channel FP8 weights,
unquantized activations). Anything else (sparsity, transforms, KV-cache schemes, other bit
widths) is refused at start, naming the scheme.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.engine.quantization import w8a8_triton
from services.engine.quantization.base import LinearMethod, QuantConfig
from services.engine.quantization.fp8_w8a16 import FP8W8A16Method
from services.engine.quantization.w8a8_int8 import W8A8Int8Method

# (scheme's description, the devices it runs on, a test of a config group, the method).
_W8A8 = "W8A8 int8 (per-channel symmetric int8 weights, dynamic per-token int8 activations)"
_FP8 = "FP8 W8A16 (per-channel float8_e4m3fn weights, activations unquantized)"
SUPPORTED = {_W8A8: ("cpu",), _FP8: ("cpu",)}


@dataclass(frozen=True, slots=True)
class _Group:
    targets: tuple[str, ...]
    method: LinearMethod


def _int8_w8a8(weights: dict[str, Any], acts: dict[str, Any] | None) -> bool:
    return (
        _is(weights, type="int", num_bits=8, strategy="channel", symmetric=True, dynamic=False)
        and acts is not None
        and _is(acts, type="int", num_bits=8, strategy="token", symmetric=True, dynamic=True)
    )


def _fp8_w8a16(weights: dict[str, Any], acts: dict[str, Any] | None) -> bool:
    return acts is None and _is(weights, type="float", num_bits=8, strategy="channel",
                                symmetric=True, dynamic=False)


_SCHEMES: tuple[tuple[str, Callable[..., bool], LinearMethod], ...] = (
    (_W8A8, _int8_w8a8, W8A8Int8Method()),
    (_FP8, _fp8_w8a16, FP8W8A16Method()),
)


def _is(args: dict[str, Any], **want: Any) -> bool:
    return all(args.get(k) == v for k, v in want.items())


class CompressedTensorsConfig(QuantConfig):
    name = "compressed-tensors"

    def __init__(self, groups: list[_Group], ignore: tuple[str, ...]) -> None:
        self.groups = groups
        self.ignore = ignore

    @classmethod
    def from_hf(cls, raw: dict[str, Any], device: torch.device) -> CompressedTensorsConfig:
        for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
            if raw.get(key):
                raise ValueError(f"compressed-tensors {key} is not supported (only weight and "
                                 f"activation quantization of linear layers)")
        groups = [_group(name, g, device) for name, g in (raw.get("config_groups") or {}).items()]
        if not groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        return cls(groups, tuple(raw.get("ignore") or ()))

    def linear_method(self, sources: tuple[str, ...]) -> LinearMethod | None:
        methods = {self._method(name) for name in sources}
        if len(methods) > 1:
            raise ValueError(f"the fused projection of {', '.join(sources)} mixes quantization "
                             f"schemes; its parts must share one")
        return methods.pop()

    def _method(self, name: str) -> LinearMethod | None:
        if any(_matches(p, name) for p in self.ignore):
            return None
        for group in self.groups:
            if any(_matches(t, name) for t in group.targets):
                return group.method
        return None


def _matches(pattern: str, name: str) -> bool:
    """compressed-tensors' target syntax for linear layers: the class name ``Linear``, a
    ``re:`` regex matched at the start of the module name, or the name itself."""
    if pattern == "Linear":
        return True
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name


def _group(name: str, raw: dict[str, Any], device: torch.device) -> _Group:
    weights, acts = raw.get("weights") or {}, raw.get("input_activations")
    if raw.get("output_activations"):
        raise ValueError(f"compressed-tensors group {name!r}: output_activations are not "
                         "supported")
    for label, test, method in _SCHEMES:
        if test(weights, acts):
            if device.type not in SUPPORTED[label] and not (
                    label == _W8A8 and device.type == "cuda" and w8a8_triton.allowed_on_gpu()):
                gpu = (f" (on a GPU: its Triton kernel, turned off by {w8a8_triton.TRITON_ENV}=0 "
                       "or absent without Triton)" if label == _W8A8 else "")
                raise ValueError(f"compressed-tensors {label} runs on "
                                 f"{', '.join(SUPPORTED[label])} only, not {device.type}{gpu}")
            return _Group(tuple(raw.get("targets") or ()), method)
    raise ValueError(
        f"compressed-tensors group {name!r} (weights {_describe(weights)}, input activations "
        f"{_describe(acts)}) is not supported; supported on {device.type}: "
        f"{'; '.join(k for k, v in SUPPORTED.items() if device.type in v) or 'none'}")


def _describe(args: dict[str, Any] | None) -> str:
    if not args:
        return "unquantized"
    keys = ("type", "num_bits", "strategy", "group_size", "symmetric", "dynamic")
    return "{" + ", ".join(f"{k}={args.get(k)}" for k in keys if args.get(k) is not None) + "}"
