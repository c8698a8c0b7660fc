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


def has_native_bf16() -> bool:
    """bfloat16 dot products in hardware (AVX-512-BF16 or AMX)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def has_amx() -> bool:
    """AMX tiles for bfloat16 (Intel Xeon, Sapphire Rapids and later)."""
    flags = cpu_flags()
    return "amx_bf16" in flags and "amx_tile" in flags
