"""Where the default model (SmolLM2-135M-Instruct) lives once converted: its name, the cache
directory and the marker that says the conversion finished.

Torch-free, so the gateway and ``make serve`` find the model without importing the engine;
the conversion itself (GGUF -> safetensors, once) is the engine's
``python -m services.engine.models.default``, which ``make install`` runs.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE_ENV = "PAGODA_MODEL_CACHE"
MARKER = ".complete"  # written last by the conversion: a directory without it is unfinished
CONVERT_COMMAND = "python -m services.engine.models.default"


def cache_root() -> Path:
    """Directory that holds converted models (``$PAGODA_MODEL_CACHE`` or the user cache)."""
    configured = os.environ.get(CACHE_ENV)
    root = Path(configured) if configured else Path.home() / ".cache" / "pagoda" / "models"
    return root.expanduser()


def default_model_dir() -> Path:
    """The converted default model's directory (which may not exist yet)."""
    return cache_root() / DEFAULT_MODEL_NAME


def is_converted(path: Path) -> bool:
    return (path / MARKER).is_file()


def converted_default_model() -> Path:
    """The default model's directory; ``FileNotFoundError`` naming the command that converts
    it when it is not there yet."""
    path = default_model_dir()
    if not is_converted(path):
        raise FileNotFoundError(
            f"the default model is not converted yet ({path}); run `{CONVERT_COMMAND}` "
            "(`make install` does) or pass --model"
        )
    return path
