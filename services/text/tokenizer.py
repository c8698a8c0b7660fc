"""Loads a model directory's tokenizer and applies its chat template."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class Tokenizer:
    """A thin wrapper over the HF fast tokenizer of a local model directory (never a hub)."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self.eos_token_id: int | None = self.hf.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

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
