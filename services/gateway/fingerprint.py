"""What the gateway says about the serving stack it fronts: its version (``GET /version``) and
a model's ``system_fingerprint`` (every completion and chat response and stream chunk, as
vLLM's server sends it).

The fingerprint names the configuration that served a response, so a client can tell when
that changed between two answers: ``pagoda-<version>-<8 hex>``, the hex a hash of the version,
the model's name and directory, the block size and the context length the engines report. It
is computed when one of those changes, never per request.
"""

from __future__ import annotations

import hashlib

from services.common.version import package_version

__all__ = ["package_version", "system_fingerprint"]


def system_fingerprint(name: str, path: str, block_size: int, max_model_len: int | None) -> str:
    version = package_version()
    config = "\0".join((version, name, path, str(block_size), str(max_model_len)))
    return f"pagoda-{version}-{hashlib.sha256(config.encode()).hexdigest()[:8]}"
