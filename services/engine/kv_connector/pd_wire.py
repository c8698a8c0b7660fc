"""The P/D transfer's wire: length-prefixed frames, each read against a deadline and refused
past a bound, JSON control messages (never pickle), and KV blocks as raw bytes behind an xxh3
checksum.

One connection, one pull::

    client -> server   frame: the internal credential ("Bearer <token>")
    client -> server   frame: JSON {"transfer_id", "first", "count", "layout"}
    server -> client   frame: JSON {"ok": true, "count": n} | {"ok": false, "error": "..."}
    server -> client   n frames: 8-byte xxh3-64 of the block, then the block's bytes

A block's bytes are every layer's key block then value block, in layer order, as the pool holds
them; both engines' layouts match (``layout_digest``) or nothing is pulled.
"""

from __future__ import annotations

import hashlib
import json
import socket
import struct
import time
from typing import Any

import torch
import xxhash

_LEN = struct.Struct(">I")
_SUM = struct.Struct(">Q")
MAX_CONTROL_BYTES = 4096  # a credential or a pull request: a few hundred bytes


class WireError(Exception):
    """The peer broke the protocol, was too slow, or went away."""


def layout_digest(model_name: str, block_size: int,
                  kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """What two engines must share for one's blocks to be the other's: the model, the block
    size, and each layer's per-block KV shape and dtype (layers, KV heads, head size)."""
    layers = [(str(k.dtype), tuple(k.shape[1:]), str(v.dtype), tuple(v.shape[1:]))
              for k, v in kv_caches]
    text = json.dumps([model_name, block_size, layers])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def block_bytes(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(k[0].nbytes + v[0].nbytes for k, v in kv_caches)


def read_block(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_id: int) -> bytes:
    parts = []
    for k, v in kv_caches:
        for t in (k[block_id], v[block_id]):
            parts.append(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return b"".join(parts)


def write_block(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_id: int,
                data: bytes) -> None:
    assert len(data) == block_bytes(kv_caches)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    at = 0
    for k, v in kv_caches:
        for t in (k[block_id], v[block_id]):
            n = t.nbytes
            t.copy_(raw[at:at + n].view(t.dtype).view(t.shape))
            at += n


def checksummed(data: bytes) -> bytes:
    return _SUM.pack(xxhash.xxh3_64_intdigest(data)) + data


def verified(frame: bytes) -> bytes:
    if len(frame) < _SUM.size:
        raise WireError("a block frame shorter than its checksum")
    (expected,), data = _SUM.unpack_from(frame), frame[_SUM.size:]
    if xxhash.xxh3_64_intdigest(data) != expected:
        raise WireError("a block's checksum does not match")
    return data


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LEN.pack(len(payload)) + payload)


def send_json(sock: socket.socket, message: dict[str, Any]) -> None:
    send_frame(sock, json.dumps(message).encode())


def recv_frame(sock: socket.socket, max_bytes: int, deadline: float) -> bytes:
    """One frame, refused when it announces more than ``max_bytes`` or has not fully arrived by
    ``deadline`` (monotonic): a peer that trickles bytes is cut off as one that sends none."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline))
    if n > max_bytes:
        raise WireError(f"a frame of {n} bytes (at most {max_bytes})")
    return _recv_exact(sock, n, deadline)


def recv_json(sock: socket.socket, deadline: float) -> dict[str, Any]:
    try:
        message = json.loads(recv_frame(sock, MAX_CONTROL_BYTES, deadline))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise WireError("a control frame that is not JSON") from None
    if not isinstance(message, dict):
        raise WireError("a control frame that is not a JSON object")
    return message


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WireError("the peer was too slow")
        sock.settimeout(left)
        try:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
        except TimeoutError:
            raise WireError("the peer was too slow") from None
        if not chunk:
            raise WireError("the peer closed the connection")
        buf += chunk
    return bytes(buf)
