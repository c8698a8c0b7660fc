"""`make serve` with vLLM's LoRA flags (issue 24): the Makefile's LORA_* variables become serve's
own flags (admin key, runtime routes) and engine flags that the engine's parser reads back as
the adapters meant. ``make -n`` prints the command without running anything."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _serve_argv(*variables: str) -> list[str]:
    out = subprocess.run(["make", "-n", "-s", "-C", str(ROOT), "serve", "PY=python", *variables],
                         capture_output=True, text=True, check=True).stdout
    (line,) = [c for c in out.replace("\\\n", " ").splitlines() if "services.serve" in c]
    argv = shlex.split(line)
    return argv[argv.index("services.serve") + 1:]


def test_make_serve_passes_the_lora_flags() -> None:
    from services.engine.serving.server_config import configs_from_args
    from services.serve import args_from

    module = json.dumps({"name": "chat", "path": "/a/chat", "base_model_name": "m"},
                        separators=(",", ":"))
    config, engine_flags = args_from(_serve_argv(
        f"LORA_MODULES=sql=/a/sql {module}", "MAX_LORAS=2", "MAX_LORA_RANK=32",
        "MAX_CPU_LORAS=4", "LORA_ROOTS=/a", "ADMIN_API_KEY=sk-ops"))
    assert config.allow_runtime_lora_updating and config.admin_api_keys == ("sk-ops",)
    engine, server = configs_from_args(["--model=/m", *engine_flags])
    assert engine.enable_lora and (engine.max_loras, engine.max_lora_rank,
                                   engine.max_cpu_loras) == (2, 32, 4)
    assert [(m.name, m.path, m.base_model_name) for m in engine.lora_modules] == [
        ("sql", "/a/sql", None), ("chat", "/a/chat", "m")]
    assert server.lora_roots == ("/a",)
    # Without the variables: no LoRA flag at all.
    config, engine_flags = args_from(_serve_argv())
    assert engine_flags == [] and not config.allow_runtime_lora_updating
