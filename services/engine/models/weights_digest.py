"""A digest of a model directory's weights that two pods compare before serving together.

Hashing every byte of a 400B checkpoint would hold a group's start for minutes, so the digest
covers what a different checkpoint cannot share with this one at the same cost as opening it:
``config.json``, and for each ``*.safetensors`` file its name, its size, every tensor's name,
dtype and shape (read through ``safetensors``, the loader's reader) and ``_SAMPLE`` bytes at
the start, middle and end of the file. Two directories with the same digest hold the same
files unless someone rewrote values in place keeping every size, which is not what a model
update or a wrong mount looks like.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from safetensors import safe_open

_SAMPLE = 64 * 1024


def weights_digest(model_dir: str | Path) -> str:
    """16 hex characters; the same for directories holding the same checkpoint."""
    root = Path(model_dir)
    h = hashlib.sha256()
    config = root / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for path in sorted(root.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"\0{path.name}\0{size}\0".encode())
        with safe_open(str(path), framework="pt") as f:
            for name in sorted(f.keys()):
                part = f.get_slice(name)
                h.update(f"{name}:{part.get_dtype()}:{part.get_shape()};".encode())
        with path.open("rb") as f:
            for at in (0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)):
                f.seek(at)
                h.update(f.read(_SAMPLE))
    return h.hexdigest()[:16]
