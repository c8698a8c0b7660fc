"""The P/D transfer's wire: length-prefixed frames, each read against a deadline and refused
past a bound, JSON control messages (never pickle), and KV blocks as raw bytes behind an xxh3
checksum.

One connection, one pull; no token ever crosses the wire (a puller may have been pointed at
any address, so it proves the credential only to a server that proved it first)::

    client -> server   frame: JSON {"nonce": cn}                       (16 random bytes, hex)
    server -> client   frame: JSON {"nonce": sn, "proof": MAC(server, cn, sn)}
    client             checks the server's proof: no credential, no ask (and no block trusted)
    client -> server   frame: JSON {"proof": MAC(client, cn, sn), "transfer_id", "first",
                                    "count", "last_hash", "layout"}
                       or, a prefix pulled from a peer: {"proof", "hashes": [...], "layout"}
    server -> client   frame: JSON {"ok": true, "count": n} | {"ok": false, "error": "..."}
    server -> client   n frames: 8-byte xxh3-64 of the block, then the block's bytes

MAC is ``internal_mac.sign`` (HMAC-SHA256 under an internal token, labelled by direction, so a
server's proof is never a client's). ``last_hash`` is the block-hash chain's hash of the last
block asked for: the chain covers the tenant's salt, the adapter and every token before it, so
a pull for another prompt or another tenant than the held one is refused. A peer's pull names
its own request's chain hashes and gets the leading run of them the server's cache holds
(``n`` may be fewer, or 0): the same chain keeps tenants apart. A block's bytes are
every layer's key block then value block, in layer order, as the pool holds them; both engines'
layouts match (``layout_digest``) or nothing is pulled.

Not covered: the connection is not encrypted and the blocks carry a checksum, not a MAC, so an
attacker on the network path between two engines can read or alter KV in flight (as every
plaintext hop listed in docs/deploy.md's security model); they cannot learn the credential.
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

from services.common import internal_mac
from services.common.internal_auth import InternalCredential

_LEN = struct.Struct(">I")
_SUM = struct.Struct(">Q")
MAX_CONTROL_BYTES = 4096  # a hello or an answer: a few hundred bytes
MAX_ASK_BYTES = 64 * 1024  # a pull request; a peer's names up to 1,024 block hashes
_SERVER_PROOF, _CLIENT_PROOF = "pagoda-kv/2 server proof", "pagoda-kv/2 client proof"


class WireError(Exception):
    """The peer broke the protocol, was too slow, or went away; ``reason`` is the
    ``pagoda:kv_transfer_failures_total`` label."""

    reason = "protocol"


class TooSlow(WireError):
    reason = "timeout"


class SlowerThanRecompute(TooSlow):
    reason = "slower_than_recompute"


class Closed(WireError):
    reason = "connection"


class Corrupt(WireError):
    reason = "checksum"


class Unauthorized(WireError):
    reason = "unauthorized"


class Refused(WireError):
    reason = "refused"


def client_hello(sock: socket.socket, credential: InternalCredential, deadline: float) -> str:
    """The puller's half of the handshake: its proof to send with the ask, once the server
    proved it holds the credential (``Unauthorized`` otherwise: nothing more is sent)."""
    mine = internal_mac.nonce()
    send_json(sock, {"nonce": mine})
    answer = recv_json(sock, deadline)
    theirs = answer.get("nonce")
    if not _is_nonce(theirs) or not internal_mac.signed(credential, _SERVER_PROOF,
                                                        answer.get("proof"), mine, theirs):
        raise Unauthorized("the peer did not prove the internal credential")
    return internal_mac.sign(credential, _CLIENT_PROOF, mine, theirs)


def server_hello(sock: socket.socket, credential: InternalCredential,
                 deadline: float) -> tuple[str, str]:
    """The server's half: answers the puller's nonce with its own and its proof; returns both
    nonces, which the ask's proof must cover (``client_proven``)."""
    theirs = recv_json(sock, deadline).get("nonce")
    if not _is_nonce(theirs):
        raise WireError("a hello without a nonce")
    mine = internal_mac.nonce()
    send_json(sock, {"nonce": mine,
                     "proof": internal_mac.sign(credential, _SERVER_PROOF, theirs, mine)})
    return theirs, mine


def client_proven(credential: InternalCredential, nonces: tuple[str, str], proof: object) -> bool:
    return internal_mac.signed(credential, _CLIENT_PROOF, proof, *nonces)


def _is_nonce(value: object) -> bool:
    return isinstance(value, str) and len(value) == 2 * internal_mac.NONCE_BYTES and all(
        c in "0123456789abcdef" for c in value)


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
        raise Corrupt("a block frame shorter than its checksum")
    (expected,), data = _SUM.unpack_from(frame), frame[_SUM.size:]
    if xxhash.xxh3_64_intdigest(data) != expected:
        raise Corrupt("a block's checksum does not match")
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


def recv_json(sock: socket.socket, deadline: float,
              max_bytes: int = MAX_CONTROL_BYTES) -> dict[str, Any]:
    try:
        message = json.loads(recv_frame(sock, max_bytes, deadline))
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
            raise TooSlow("the peer was too slow")
        sock.settimeout(left)
        try:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
        except TimeoutError:
            raise TooSlow("the peer was too slow") from None
        if not chunk:
            raise Closed("the peer closed the connection")
        buf += chunk
    return bytes(buf)
