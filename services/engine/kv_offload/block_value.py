"""One block's value in the shared store, authenticated with the deployment's MAC key.

Layout (little-endian)::

    magic "PKV2" | number of tokens (u32) | tag (32 bytes) | KV bytes

``tag`` is HMAC-SHA256, under a key derived from the secret (``secret``), over the store key
the value lives under, the block's tokens and its KV bytes. So a value is used only if it was
written, for exactly this key and these tokens, by an engine holding the secret: anything the
store's other clients wrote, a value moved to another key (another tenant's, another model's
namespace), a flipped byte, or a block hash that collided with another prompt's is a miss
(recomputed). The tokens are in the tag, not in the value: a value holds no token ids.

HMAC-SHA256 costs about 0.6-0.9 ms per MiB on a core with SHA extensions (xxh3 was 0.05), and
hashlib leaves the GIL while it hashes: it runs on the copy and writer threads, never on the
step's.
"""

from __future__ import annotations

import hmac
import struct
from collections.abc import Sequence

from services.engine.kv_offload.secret import MIN_SECRET_BYTES

_MAGIC = b"PKV2"
_HEADER = struct.Struct("<4sI32s")  # magic, number of tokens, tag
_KEY_DOMAIN = b"pagoda/kv-store/block-mac/v1"


class BlockCodec:
    """Encodes and checks values under one secret (thread-safe: no state but the key)."""

    def __init__(self, secret: bytes) -> None:
        assert len(secret) >= MIN_SECRET_BYTES  # secret.load_store_secret checked it
        self._key = hmac.digest(secret, _KEY_DOMAIN, "sha256")

    def encode(self, key: bytes, token_ids: Sequence[int], payload: bytes) -> bytes:
        tag = self._tag(key, token_ids, payload)
        return _HEADER.pack(_MAGIC, len(token_ids), tag) + payload

    def decode(self, key: bytes, value: bytes, token_ids: Sequence[int],
               payload_bytes: int) -> bytes | None:
        """The block's KV bytes, or None unless ``value`` is exactly this block as an engine
        with the secret wrote it under ``key``."""
        if len(value) != _HEADER.size + payload_bytes:
            return None
        magic, count, tag = _HEADER.unpack_from(value)
        if magic != _MAGIC or count != len(token_ids):
            return None
        payload = memoryview(value)[_HEADER.size:]
        if not hmac.compare_digest(tag, self._tag(key, token_ids, payload)):
            return None
        return bytes(payload)

    def _tag(self, key: bytes, token_ids: Sequence[int], payload: bytes | memoryview) -> bytes:
        mac = hmac.new(self._key, digestmod="sha256")
        mac.update(struct.pack("<I", len(key)))  # lengths first: no two fields can trade bytes
        mac.update(key)
        mac.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
        mac.update(payload)
        return mac.digest()
