"""The messages between the engine server and its engine-core process, and their framing.

A message is one of the core loop's commands (server -> core), or a ``CoreOutputs`` batch,
an ``EngineInfo`` or a ``LoadFailed`` (core -> server). Each travels as one pickle (protocol
5) in one ``Connection.send_bytes`` frame (a length prefix, then the bytes); ``CoreOutputs``
that queued while the core sent the last frame travel together, as a list. Both ends are
this codebase in processes we start, so pickle's trust model holds; it encodes the slotted
dataclasses of a 256-request step in a fraction of a millisecond, in C.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

_PROTOCOL = 5


@dataclass(frozen=True, slots=True)
class LoadFailed:
    """The core could not load the engine; the server reports it on /health."""

    message: str


def encode(msg: object) -> bytes:
    return pickle.dumps(msg, protocol=_PROTOCOL)


def decode(data: bytes) -> object:
    return pickle.loads(data)
