"""What the CPU can do, read once from ``/proc/cpuinfo``: the kernels are chosen by it.

Three kinds of x86 machine run the CPU engine (README, "What has run where"): AVX2 only,
AVX-512 with AVX-512-BF16 (AMD EPYC), and AVX-512 with AMX (Intel Xeon), whose tile units
multiply bfloat16 matrices several times faster than vector instructions. oneDNN and torch's
attention pick their own code path by the same flags; the engine's choices that depend on them
(which attention path a prefill takes, how bf16 weights are packed) ask here.
"""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """bfloat16 dot products in hardware (AVX-512-BF16 or AMX); ``flags``: this CPU's."""
    flags = cpu_flags() if flags is None else flags
    return "avx512_bf16" in flags or "amx_bf16" in flags


def has_amx(flags: frozenset[str] | None = None) -> bool:
    """AMX tiles for bfloat16 (Intel Xeon, Sapphire Rapids and later); ``flags``: this CPU's."""
    flags = cpu_flags() if flags is None else flags
    return "amx_bf16" in flags and "amx_tile" in flags


def has_int8_dot(flags: frozenset[str] | None = None) -> bool:
    """int8 dot products in hardware (AVX512-VNNI or AMX-INT8), which oneDNN's int8 GEMM behind
    ``torch._int_mm`` uses; without them it takes a reference path (``csrc/w8a8.cpp`` instead).
    ``flags``: this CPU's."""
    flags = cpu_flags() if flags is None else flags
    return "avx512_vnni" in flags or "amx_int8" in flags


def has_amx_int8(flags: frozenset[str] | None = None) -> bool:
    """AMX tiles for int8 (Intel Xeon, Sapphire Rapids and later); ``flags``: this CPU's."""
    flags = cpu_flags() if flags is None else flags
    return "amx_int8" in flags and "amx_tile" in flags
