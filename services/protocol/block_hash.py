"""The block-hash chain: the one contract shared by gateway, router and engine.

For a prompt cut into blocks of ``block_size`` tokens (full blocks only)::

    h_0 = H(seed(model, block_size, cache_salt, adapter))
    h_i = H(h_{i-1} || token_ids of block i)

Because each hash covers its parent, equal hashes mean equal whole prefixes. ``adapter`` is
the LoRA adapter a request runs under (``AdapterKey``: its name and the version of its
weights), as vLLM's extra keys: the same prompt under two adapters, or under one name whose
weights were replaced, never shares a block; without one the seed is the base model's.

The engine's prefix cache keys blocks by these hashes, the router indexes them in Redis, and
the gateway computes them from the templated prompt (with the adapter the request names), so
all three must call this module and nothing else.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NewType

import xxhash

# 16 raw bytes. A NewType so that arbitrary bytes are not passed where a chain hash is meant.
BlockHash = NewType("BlockHash", bytes)

_SEED_DOMAIN = b"pagoda/block-hash/v1"


class HashAlgorithm(StrEnum):
    XXH3_128 = "xxh3_128"
    SHA256 = "sha256"  # truncated to 128 bits; for deployments that want a cryptographic hash


def _digest(algorithm: HashAlgorithm, data: bytes) -> BlockHash:
    if algorithm is HashAlgorithm.XXH3_128:
        return BlockHash(xxhash.xxh3_128_digest(data))
    return BlockHash(hashlib.sha256(data).digest()[:16])


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    # Little-endian uint32 whatever the host, so every replica hashes the same bytes.
    try:
        arr = array("I", token_ids)
    except (OverflowError, TypeError):
        raise ValueError("token ids must be integers in [0, 2**32)") from None
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr.tobytes()


_BIG_ENDIAN = sys.byteorder != "little"


def _chain_digest(algorithm: HashAlgorithm, parent: BlockHash,
                  token_ids: Sequence[int]) -> BlockHash:
    """h_i = H(h_{i-1} || token_ids of block i): one link of the chain."""
    return _digest(algorithm, parent + _token_bytes(token_ids))


@dataclass(frozen=True, slots=True)
class AdapterKey:
    """A LoRA adapter as the chain sees it: its name and the version of its weights (the
    engine's digest of the adapter's files, so every replica that loads the same files agrees,
    and new weights under an old name start a new namespace)."""

    name: str
    version: str

    def __post_init__(self) -> None:
        if not self.name or not self.version:
            raise ValueError("an adapter key needs a non-empty name and version")


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """Hashes token blocks for one (model, block_size, cache_salt, adapter, algorithm)
    namespace."""

    model: str
    block_size: int
    cache_salt: str | None = None
    algorithm: HashAlgorithm = HashAlgorithm.XXH3_128
    adapter: AdapterKey | None = None
    seed: BlockHash = field(init=False)

    def __post_init__(self) -> None:
        if (
            not isinstance(self.block_size, int)
            or isinstance(self.block_size, bool)
            or self.block_size <= 0
        ):
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if not self.model:
            raise ValueError("model must be a non-empty string")
        algorithm = HashAlgorithm(self.algorithm)
        object.__setattr__(self, "algorithm", algorithm)
        salt = b"" if self.cache_salt is None else b"\x01" + self.cache_salt.encode()
        parts = [_SEED_DOMAIN, self.model.encode(), str(self.block_size).encode(), salt]
        if self.adapter is not None:  # absent: the base model's seed, unchanged
            parts += [b"\x02" + self.adapter.name.encode(), self.adapter.version.encode()]
        material = b"\x00".join(parts)
        object.__setattr__(self, "seed", _digest(algorithm, material))

    def hash_block(self, parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
        if len(token_ids) != self.block_size:
            raise ValueError(
                f"a block holds exactly {self.block_size} tokens, got {len(token_ids)}"
            )
        return _chain_digest(self.algorithm, parent, token_ids)

    def chain(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """Hashes of every full block of ``token_ids``, in order."""
        return self.extend([], token_ids)

    def extend(self, hashes: list[BlockHash], token_ids: Sequence[int]) -> list[BlockHash]:
        """Appends to ``hashes`` (the chain of a prefix of ``token_ids``) the hashes of the
        full blocks that follow it, and returns the same list. (``hash_block``'s work without
        its length check: the slices here are whole blocks. The engine calls it each time a
        request's block fills.)"""
        bs = self.block_size
        num_full = len(token_ids) // bs
        parent = hashes[-1] if hashes else self.seed
        algorithm = self.algorithm
        for i in range(len(hashes), num_full):
            parent = _chain_digest(algorithm, parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return hashes


def block_hash_chain(
    token_ids: Sequence[int],
    block_size: int,
    model: str,
    cache_salt: str | None = None,
    algorithm: HashAlgorithm = HashAlgorithm.XXH3_128,
    adapter: AdapterKey | None = None,
) -> list[BlockHash]:
    """Convenience wrapper: the chain of ``token_ids`` in one call."""
    return BlockHasher(model, block_size, cache_salt, algorithm, adapter).chain(token_ids)
