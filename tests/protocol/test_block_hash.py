"""The block-hash chain shared by gateway, router and engine (services/protocol/block_hash.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.protocol.block_hash import (
    AdapterKey,
    BlockHash,
    BlockHasher,
    HashAlgorithm,
    block_hash_chain,
)

TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # two full blocks of 4 and one spare token

token_lists = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=40)


def test_known_answer_vectors() -> None:
    # Pinned digests: gateway, router and engine of different versions must agree, and a change
    # here silently invalidates every engine cache and the router's Redis index.
    hasher = BlockHasher("tiny-llama", 4)
    assert hasher.seed.hex() == "b3e3a450d6135eefe195d4ec5becb418"
    assert [h.hex() for h in hasher.chain(TOKENS)] == [
        "0913497f69c74c63bd700abeaab6a815",
        "94a34cc8e1c5a5dd2f68de1c76e47173",
    ]
    sha = BlockHasher("tiny-llama", 4, algorithm=HashAlgorithm.SHA256)
    assert sha.seed.hex() == "577cc4bc724552c887269b171e3ada78"
    assert [h.hex() for h in sha.chain(TOKENS)] == [
        "305f946c06851fcef439fee8deb8f87b",
        "6d3d65921510f55e3e0e53688c3a1860",
    ]


def test_deterministic_across_instances() -> None:
    first = BlockHasher("m", 4, cache_salt="tenant").chain(TOKENS)
    second = BlockHasher("m", 4, cache_salt="tenant").chain(list(TOKENS))
    assert first == second
    assert all(isinstance(h, bytes) and len(h) == 16 for h in first)


def test_only_full_blocks_are_hashed() -> None:
    hasher = BlockHasher("m", 4)
    assert hasher.chain([]) == []
    assert hasher.chain([1, 2, 3]) == []
    assert len(hasher.chain([1, 2, 3, 4])) == 1
    assert len(hasher.chain(list(range(11)))) == 2
    # The spare tokens of a partial block change nothing.
    assert hasher.chain([1, 2, 3, 4, 5]) == hasher.chain([1, 2, 3, 4, 99, 98, 97])


def test_hash_depends_on_parent() -> None:
    hasher = BlockHasher("m", 2)
    after_a = hasher.chain([1, 1, 7, 8])
    after_b = hasher.chain([2, 2, 7, 8])
    # Same second-block tokens, different prefixes: different hashes, so equal hashes mean
    # equal whole prefixes.
    assert after_a[1] != after_b[1]
    assert after_a[1] == hasher.hash_block(after_a[0], [7, 8])
    assert hasher.chain([1, 1])[0] == hasher.hash_block(hasher.seed, [1, 1])


def test_token_order_and_values_matter() -> None:
    hasher = BlockHasher("m", 2)
    assert hasher.chain([1, 2]) != hasher.chain([2, 1])
    # Tokens are fixed-width uint32, so (1, 256) and (256, 1) cannot collide via byte packing.
    assert hasher.chain([1, 256]) != hasher.chain([256, 1])


@given(tokens=token_lists, split=st.integers(min_value=0, max_value=40))
@settings(max_examples=60, deadline=None)
def test_extend_equals_chain(tokens: list[int], split: int) -> None:
    hasher = BlockHasher("m", 3)
    prefix = hasher.chain(tokens[:split])
    extended = hasher.extend(prefix, tokens)
    assert extended is prefix  # extends in place
    assert extended == hasher.chain(tokens)


@given(tokens=token_lists)
@settings(max_examples=60, deadline=None)
def test_chain_of_prefix_is_prefix_of_chain(tokens: list[int]) -> None:
    hasher = BlockHasher("m", 3)
    full = hasher.chain(tokens)
    for k in range(len(full) + 1):
        assert hasher.chain(tokens[: 3 * k]) == full[:k]


def test_extend_token_by_token_equals_chain() -> None:
    # How the engine grows a decoding request's chain one generated token at a time.
    hasher = BlockHasher("m", 4)
    tokens = list(range(100, 130))
    hashes: list[BlockHash] = []
    for n in range(len(tokens) + 1):
        hasher.extend(hashes, tokens[:n])
        assert hashes == hasher.chain(tokens[:n])


@pytest.mark.parametrize(
    "other",
    [
        BlockHasher("other-model", 4),
        BlockHasher("m", 8),
        BlockHasher("m", 4, cache_salt="tenant-a"),
        BlockHasher("m", 4, cache_salt=""),  # an empty salt is still a salt, not "no salt"
        BlockHasher("m", 4, algorithm=HashAlgorithm.SHA256),
        BlockHasher("m", 4, adapter=AdapterKey("sql", "0123456789abcdef")),
    ],
    ids=["model", "block_size", "cache_salt", "empty_salt", "sha256", "adapter"],
)
def test_namespace_changes_seed_and_chain(other: BlockHasher) -> None:
    base = BlockHasher("m", 4)
    tokens = list(range(16))
    assert other.seed != base.seed
    assert set(other.chain(tokens)).isdisjoint(base.chain(tokens))


def test_salts_isolate_tenants() -> None:
    tokens = list(range(8))
    assert BlockHasher("m", 4, "a").chain(tokens) != BlockHasher("m", 4, "b").chain(tokens)


def test_adapters_and_their_weights_isolate_blocks() -> None:
    """The adapter's name and weights' version key the chain (as vLLM's extra keys): two
    adapters, or new weights under one name, never share a block; the salt still applies."""
    tokens = list(range(8))
    v1, v2 = AdapterKey("sql", "aaaa"), AdapterKey("sql", "bbbb")
    chains = [BlockHasher("m", 4, adapter=k).chain(tokens)
              for k in (v1, v2, AdapterKey("chat", "aaaa"), None)]
    assert len({tuple(c) for c in chains}) == 4
    assert BlockHasher("m", 4, "t", adapter=v1).chain(tokens) != chains[0]
    assert block_hash_chain(tokens, 4, "m", adapter=v1) == chains[0]
    with pytest.raises(ValueError):
        AdapterKey("sql", "")


def test_sha256_option() -> None:
    by_name = BlockHasher("m", 4, algorithm="sha256")  # type: ignore[arg-type]
    assert by_name.algorithm is HashAlgorithm.SHA256
    hashes = by_name.chain(list(range(8)))
    assert len(hashes) == 2 and all(len(h) == 16 for h in hashes)
    assert hashes == BlockHasher("m", 4, algorithm=HashAlgorithm.SHA256).chain(list(range(8)))
    assert hashes != BlockHasher("m", 4).chain(list(range(8)))


def test_block_hash_chain_wrapper_matches_hasher() -> None:
    tokens = list(range(20))
    assert block_hash_chain(tokens, 4, "m", "salt", HashAlgorithm.SHA256) == BlockHasher(
        "m", 4, "salt", HashAlgorithm.SHA256
    ).chain(tokens)


@pytest.mark.parametrize("block_size", [0, -4, 2.0, "16", None])
def test_bad_block_size_raises(block_size: object) -> None:
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher("m", block_size)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size"):
        block_hash_chain([1, 2, 3], block_size, "m")  # type: ignore[arg-type]


def test_bool_block_size_raises() -> None:
    with pytest.raises(ValueError):
        BlockHasher("m", True)


def test_bad_inputs_raise_value_error() -> None:
    with pytest.raises(ValueError, match="model"):
        BlockHasher("", 4)
    with pytest.raises(ValueError):
        BlockHasher("m", 4, algorithm="md5")  # type: ignore[arg-type]
    hasher = BlockHasher("m", 4)
    with pytest.raises(ValueError, match="exactly 4 tokens"):
        hasher.hash_block(hasher.seed, [1, 2, 3])
