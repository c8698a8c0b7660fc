"""One reader of a model directory's config.json and generation_config.json, one end-of-sequence
rule (the union of both files' ``eos_token_id``, as vLLM and transformers): the engine's
``ModelConfig``, the gateway's tokenizer and its context length all read the same values."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from services.common.model_files import ModelFiles, context_length, eos_token_ids
from services.engine.models.config import ModelConfig
from services.gateway.models import context_length_of
from services.text.tokenizer import Tokenizer

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def model_dir(src: Path, dst: Path, config_eos: object, generation_eos: object | None) -> Path:
    """``src``'s config and tokenizer, with these eos ids (None: no generation_config.json)."""
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    config["eos_token_id"] = config_eos
    (dst / "config.json").write_text(json.dumps(config))
    if generation_eos is not None:
        gen = {"bos_token_id": 1, "eos_token_id": generation_eos}
        (dst / "generation_config.json").write_text(json.dumps(gen))
    for name in _TOKENIZER_FILES:
        shutil.copy(src / name, dst / name)
    return dst


@pytest.mark.parametrize(
    ("config_eos", "generation_eos", "expected"),
    [
        (2, [7, 2], (2, 7)),  # a chat model's end-of-turn only in generation_config.json
        ([2, 3], 7, (2, 3, 7)),
        (2, None, (2,)),  # no generation_config.json
        (None, [5], (5,)),
        (None, None, ()),
    ],
)
def test_engine_and_tokenizer_read_the_same_eos_ids(
    default_model_path: Path, tmp_path: Path, config_eos: object, generation_eos: object,
    expected: tuple[int, ...],
) -> None:
    path = model_dir(default_model_path, tmp_path / "m", config_eos, generation_eos)
    assert ModelFiles.read(path).eos_token_ids == expected
    assert ModelConfig.from_hf_dir(path).eos_token_ids == expected
    assert Tokenizer(path).eos_token_ids == frozenset(expected)


def test_context_length_is_the_engines(default_model_path: Path) -> None:
    assert context_length_of(default_model_path) == \
        ModelConfig.from_hf_dir(default_model_path).max_position_embeddings
    assert context_length({"text_config": {"max_position_embeddings": 9}, "n_positions": 5}) == 9
    assert context_length({"n_positions": 1024}) == 1024
    assert context_length({"max_position_embeddings": True}) is None


@pytest.mark.parametrize("bad", ["2", 2.0, True, -1, [2, None], {"id": 2}])
def test_a_bad_eos_value_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="eos_token_id"):
        eos_token_ids({"eos_token_id": bad}, {})
    with pytest.raises(ValueError, match="generation_config.json"):
        eos_token_ids({}, {"eos_token_id": bad})


def test_missing_or_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelFiles.read(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        ModelFiles.read(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelFiles.read(tmp_path)
    assert context_length_of(tmp_path) is None  # the gateway falls back to the engines'
    (tmp_path / "config.json").write_text('{"eos_token_id": 4}')
    assert ModelFiles.read(tmp_path) == ModelFiles({"eos_token_id": 4}, {})
