"""Loads a model directory's tokenizer and applies its chat template."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.common.model_files import ModelFiles

logger = logging.getLogger(__name__)


class Tokenizer:
    """A thin wrapper over the HF fast tokenizer of a local model directory (never a hub)."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        # The ids that end a request: the engine's set, by the one rule (model_files).
        self.eos_token_ids = frozenset(ModelFiles.read(model_dir).eos_token_ids)
        # The Rust tokenizer, when its decode is ours unchanged (no clean-up pass in Python).
        backend = getattr(self.hf, "backend_tokenizer", None)
        cleans_up = bool(getattr(self.hf, "clean_up_tokenization_spaces", False))
        self._backend = None if cleans_up else backend
        self.decodes_bytewise = self._backend is not None and _is_byte_level(self._backend)
        # Added tokens (special or not) decode as their own text, not through the BPE bytes.
        self.added_token_ids = frozenset(getattr(self.hf, "added_tokens_decoder", {}))
        self._token_bytes: dict[bool, list[bytes | None]] = {}  # by skip_special_tokens

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(
        self, seqs: Sequence[Sequence[int]], skip_special_tokens: bool = True
    ) -> list[str]:
        """``decode`` of each sequence, in one call into the Rust tokenizer when there is one."""
        if self._backend is None:
            return [self.decode(s, skip_special_tokens) for s in seqs]
        return self._backend.decode_batch(
            [list(s) for s in seqs], skip_special_tokens=skip_special_tokens
        )

    def token_bytes(self, skip_special_tokens: bool = True) -> list[bytes | None]:
        """Each id's bytes under byte-level decoding (``decodes_bytewise``), what a run of them
        decodes from: an added token's are its own text's (nothing when it is special and
        skipped); None where that text holds a U+FFFD. Built on first use (~0.1 s, 49k ids)."""
        table = self._token_bytes.get(skip_special_tokens)
        if table is None:
            table = self._token_bytes[skip_special_tokens] = self._build_token_bytes(
                skip_special_tokens)
        return table

    def built_token_bytes(self, skip_special_tokens: bool = True) -> list[bytes | None] | None:
        """``token_bytes`` if something has built it already, else None (not worth building
        for a decode the Rust tokenizer does)."""
        return self._token_bytes.get(skip_special_tokens)

    def _build_token_bytes(self, skip: bool) -> list[bytes | None]:
        assert self.decodes_bytewise and self._backend is not None
        byte_of = _byte_of_char()
        table: list[bytes | None] = [None] * len(self.hf)
        for token, i in self._backend.get_vocab(with_added_tokens=False).items():
            if i < len(table) and all(ch in byte_of for ch in token):
                table[i] = bytes(byte_of[ch] for ch in token)
        for i in self.added_token_ids:
            text = self.decode([i], skip)
            if i < len(table):
                table[i] = None if "\ufffd" in text else text.encode()
        return table

    def convert_id_to_token(self, token_id: int) -> str:
        return self.hf.convert_ids_to_tokens(int(token_id))

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Renders a conversation to the prompt text the model was trained on."""
        if not messages:
            raise ValueError("messages must contain at least one message")
        if chat_template is None and not self.hf.chat_template:
            raise ValueError("this model has no chat template; use a plain completion instead")
        return self.hf.apply_chat_template(
            list(messages),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            **kwargs,
        )

    def encode_chat(self, messages: Sequence[dict[str, Any]], **kwargs: Any) -> list[int]:
        # The template already holds any BOS the model wants: don't add special tokens twice.
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)


def _is_byte_level(backend: Any) -> bool:
    """True for byte-level BPE decoding (GPT-2, Llama 3, Qwen, SmolLM2): a run of ordinary
    tokens decodes to the UTF-8 of their concatenated bytes, each invalid or unfinished
    sequence as one U+FFFD (``detokenizer.detokenize_batch`` relies on it)."""
    from tokenizers import decoders

    return isinstance(backend.decoder, decoders.ByteLevel)


def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's table), read back: each byte has a printable stand-in,
    a printable Latin-1 byte itself, every other byte 256, 257, ... in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + k): b for k, b in enumerate(moved)}}
