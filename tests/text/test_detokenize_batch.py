"""``detokenize_batch`` gives exactly the text ``IncrementalDetokenizer`` builds, in one batch."""

from __future__ import annotations

import random

import pytest

from services.text import detokenizer
from services.text.detokenizer import IncrementalDetokenizer, detokenize_batch
from services.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(default_model_path) -> Tokenizer:
    tokenizer = Tokenizer(default_model_path)
    assert tokenizer.decodes_bytewise  # SmolLM2: byte-level BPE, the batched path
    return tokenizer


def incremental(tok: Tokenizer, prompt: list[int], output: list[int], skip: bool) -> str:
    detok = IncrementalDetokenizer(tok, prompt, skip)
    for t in output:  # one token per step, as the engine delivers them
        detok.push([t])
    return detok.text


def token_pools(tok: Tokenizer) -> tuple[list[int], list[int], list[int]]:
    """Byte fragments (decode alone to U+FFFD), added/special tokens, and ordinary tokens."""
    fragments = [i for i in range(len(tok.hf)) if "\ufffd" in tok.decode([i])]
    added = sorted(tok.hf.added_tokens_decoder)
    ordinary = list(range(1000, 1200))
    ordinary += tok.encode(" 中文 € naïve", add_special_tokens=False)
    return fragments, added, ordinary


def random_seq(rng: random.Random, pools, length: int) -> list[int]:
    fragments, added, ordinary = pools
    weights = (0.45, 0.15, 0.40)  # mostly fragments: characters split, left open, completed
    return [rng.choice(rng.choices((fragments, added, ordinary), weights)[0])
            for _ in range(length)]


@pytest.mark.parametrize("skip", [True, False])
def test_equals_incremental_on_random_sequences(tok: Tokenizer, skip: bool) -> None:
    rng = random.Random(1234 + skip)
    pools = token_pools(tok)
    prompts = [random_seq(rng, pools, rng.randint(1, 8)) for _ in range(400)]
    outputs = [random_seq(rng, pools, rng.randint(0, 24)) for _ in range(400)]
    expected = [incremental(tok, p, o, skip) for p, o in zip(prompts, outputs, strict=True)]
    assert detokenize_batch(tok, prompts, outputs, skip) == expected


def test_split_characters_and_special_tokens(tok: Tokenizer) -> None:
    emoji = tok.encode("😀", add_special_tokens=False)  # three byte tokens
    assert len(emoji) > 1
    prompt = tok.encode("Say:", add_special_tokens=False)
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    cases = [
        (prompt, emoji + tok.encode(" ok", add_special_tokens=False)),  # completed character
        (prompt, emoji[:2]),  # ends inside a character: that tail is never emitted
        (prompt + emoji[:1], emoji[1:]),  # the prompt ends inside a character
        (prompt, [emoji[0], im_end, *emoji[1:]]),  # a special token inside a character
        (prompt, tok.encode("a\ufffdb\ufffd", add_special_tokens=False)),  # a real U+FFFD
        (prompt, [emoji[0]] * 300),  # a random model repeating one byte token
        (prompt, [*emoji[:2], *[im_end] * 6, emoji[2]]),  # skipped tokens inside the window
        (prompt, []),
    ]
    for skip in (True, False):
        expected = [incremental(tok, p, o, skip) for p, o in cases]
        assert detokenize_batch(tok, *zip(*cases, strict=True), skip) == expected
    assert detokenize_batch(tok, [prompt], [emoji], True) == ["😀"]


@pytest.mark.parametrize("bytes_built", [False, True], ids=["rust", "token-bytes"])
def test_two_batched_decodes_and_none_per_token(default_model_path, bytes_built: bool,
                                                monkeypatch) -> None:
    """Two batched decodes by the Rust tokenizer, none per token; none at all once the ids'
    bytes were built (an open tail builds them): the same texts, joined from the bytes."""
    tok = Tokenizer(default_model_path)
    if bytes_built:
        tok.token_bytes(True)
    calls = {"decode": 0, "batch": 0}
    decode, batch = tok.decode, tok.decode_batch

    def count(name, fn):
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return counted

    monkeypatch.setattr(tok, "decode", count("decode", decode))
    monkeypatch.setattr(tok, "decode_batch", count("batch", batch))
    prompts = [tok.encode(f"Prompt {i}:", add_special_tokens=False) for i in range(50)]
    outputs = [tok.encode(f" answer {i} 😀 done", add_special_tokens=False) for i in range(50)]
    texts = detokenize_batch(tok, prompts, outputs)
    assert texts == [f" answer {i} 😀 done" for i in range(50)]
    assert calls == {"decode": 0, "batch": 0 if bytes_built else 2}


@pytest.mark.parametrize("skip", [True, False])
def test_token_bytes_decode_as_the_tokenizer_does(tok: Tokenizer, skip: bool) -> None:
    """The open-tail search reads ids as bytes: joined and decoded with replacement, a run of
    them gives the Rust tokenizer's text (split characters, added tokens skipped or not)."""
    table = tok.token_bytes(skip)
    rng = random.Random(7 + skip)
    pools = token_pools(tok)
    for _ in range(500):
        ids = random_seq(rng, pools, rng.randint(1, 16))
        assert b"".join(table[i] for i in ids).decode("utf-8", "replace") == tok.decode(ids, skip)


def test_ids_without_bytes_take_the_window_search(tok: Tokenizer, monkeypatch) -> None:
    """An id past the tokenizer's vocabulary (an LM head's padding row) has no bytes: its
    sequence is searched by windows of tokens, to the same text."""
    emoji = tok.encode("😀", add_special_tokens=False)
    prompt = tok.encode("Say:", add_special_tokens=False)
    past = len(tok.hf) + 3
    assert len(tok.token_bytes(True)) <= past
    searched = []
    by_windows = detokenizer._ends_by_windows
    monkeypatch.setattr(detokenizer, "_ends_by_windows",
                        lambda tok, seqs, *a: searched.extend(seqs) or by_windows(tok, seqs, *a))
    cases = [(prompt, [*emoji, past, *emoji[:2]]), (prompt, [past, emoji[0], emoji[0]])]
    for skip in (True, False):
        expected = [incremental(tok, p, o, skip) for p, o in cases]
        assert detokenize_batch(tok, *zip(*cases, strict=True), skip) == expected
    assert searched and all(past in seq for seq in searched)
