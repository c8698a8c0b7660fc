"""Contracts shared by gateway, router and engine: the block-hash chain and wire messages."""

from services.protocol.block_hash import BlockHash, BlockHasher, HashAlgorithm, block_hash_chain

__all__ = ["BlockHash", "BlockHasher", "HashAlgorithm", "block_hash_chain"]
