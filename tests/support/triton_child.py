"""Where a Triton kernel test file runs its kernels, and its re-run under the interpreter.

Triton reads ``TRITON_INTERPRET`` when a kernel module is imported. A test file that imported
its kernels compiled on a machine without a GPU re-runs itself in a child pytest with the
interpreter on (``make test`` sets it for the whole suite, so this is for a plain ``pytest``);
on a machine with CUDA the kernels run compiled in this process and the child is not needed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

_REPO_ROOT = Path(__file__).resolve().parents[2]


def kernel_device(kernels: Iterable[object], child_env: str) -> tuple[bool, str | None]:
    """(interpreted, device): "cpu" under the interpreter, "cuda" with a GPU, else None. In
    the child (``child_env`` set) the interpreter must be on: never recurse into another."""
    from triton.runtime.interpreter import InterpretedFunction

    interpreted = all(isinstance(k, InterpretedFunction) for k in kernels)
    if os.environ.get(child_env) and not interpreted:
        raise RuntimeError("TRITON_INTERPRET=1 did not take effect in the interpreter child")
    if interpreted:
        return True, "cpu"
    return False, "cuda" if torch.cuda.is_available() else None


def run_under_interpreter(test_file: str, child_env: str, deselect: str) -> None:
    """Runs ``test_file`` (less the ``-k`` expression ``deselect``) in a child pytest with the
    interpreter on; every test must pass there (a skip would mean a kernel silently did not
    run)."""
    env = dict(os.environ, TRITON_INTERPRET="1", **{child_env: "1"})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file,
           "-k", f"not ({deselect})"]
    proc = subprocess.run(
        cmd, cwd=_REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"interpreter run failed:\n{tail}"
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, tail
