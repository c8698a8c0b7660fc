"""A digest of a model's weights, for the shared store's namespace: two weight versions served
under one name (a fine-tune rolled out over the old one) never share KV.

It hashes the bytes of every ``*.safetensors`` file of the model directory (sorted by name, each
with its name and size), not only their headers: a fine-tune has the same names, shapes and
sizes as its base, so only the tensors' bytes tell them apart. xxh3-128, because this only
separates honest versions (whoever can swap the weights owns the engine anyway; what keeps
foreign values out is the MAC) and it runs at memory speed: 0.23 s for the default 135M model
(540 MB, float32) with the files in the page cache, where loading the model just left them;
SHA-256 took 0.75 s. Files the loader would not read (a stray shard) only split namespaces
further, which is the safe direction.
"""

from __future__ import annotations

import struct
from pathlib import Path

import xxhash

_CHUNK = 16 * 1024 * 1024


def weights_digest(model_dir: str | Path) -> str:
    """32 hex digits over the directory's safetensors files (FileNotFoundError if none)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    h = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    for path in files:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            name = path.name.encode()
            h.update(struct.pack("<IQ", len(name), size) + name)
            while n := f.readinto(buf):
                h.update(view[:n])
    return h.hexdigest()
