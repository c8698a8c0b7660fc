"""Fixtures shared by the whole suite: the real default model, tiny random models, and the
session's internal credential."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from services.common.internal_auth import ensure_tokens

# One internal credential for the session, set before any service starts: every engine, router
# and gateway the tests start (in-process or as a child) requires and sends it, as in a
# deployment. Tests that call engine or router routes directly send
# tests.support.services.internal_headers().
ensure_tokens(os.environ)
# Engines start without their warm-up passes (model_runner.SKIP_WARM_UP_ENV): the suite starts
# about a hundred, each warm-up is seconds of forward passes that only make first requests
# faster. tests/engine/test_memory_budget.py and its test of the switch turn it back on.
os.environ.setdefault("PAGODA_SKIP_WARMUP", "1")

TinyModelFactory = Callable[..., Path]

# Small enough to build and run in milliseconds, big enough to exercise GQA (4 query heads
# over 2 KV heads) and a head_dim (32) that differs from hidden / heads (16).
TINY_DIMS: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
}


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The converted SmolLM2-135M-Instruct directory (converted once, then cached on disk)."""
    from services.engine.models.default import default_model_path as convert_if_needed

    return convert_if_needed()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> TinyModelFactory:
    """Factory: ``tiny_model_dir(architecture, seed=0, **config_overrides) -> Path``.

    Writes a randomly initialised HF model (safetensors) and returns its directory; the same
    arguments return the same directory. Weights are drawn wider than HF's default init and
    norm weights are perturbed away from 1, so a mistake in any layer shows in the logits.
    """
    made: dict[str, Path] = {}

    def make(architecture: str, seed: int = 0, **overrides: Any) -> Path:
        key = json.dumps([architecture, seed, overrides], sort_keys=True)
        if key not in made:
            out = tmp_path_factory.mktemp(architecture)
            _write_tiny_model(out, architecture, seed, overrides)
            made[key] = out
        return made[key]

    return make


# Architectures whose config class is not named after them (Gemma3Config is the multimodal one).
_CONFIG_CLASSES = {"Gemma3ForCausalLM": "Gemma3TextConfig"}


def _write_tiny_model(out: Path, architecture: str, seed: int, overrides: dict[str, Any]) -> None:
    # Imported here: suites that never build a model (router, gateway) skip torch's import.
    import torch
    import transformers

    name = _CONFIG_CLASSES.get(architecture, architecture.replace("ForCausalLM", "Config"))
    config_class = getattr(transformers, name)
    config = config_class(**{**TINY_DIMS, **overrides})
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1)
    model.save_pretrained(out)


@pytest.fixture(scope="session")
def fast_model_dir(tiny_model_dir: TinyModelFactory, default_model_path: Path) -> Path:
    """A random 2-layer Llama with SmolLM2's vocabulary and tokenizer, named ``pagoda-tiny``:
    real engines and gateways serve it in milliseconds per step (``tests/support/stack.py``)."""
    from tests.support.stack import write_fast_model

    return write_fast_model(tiny_model_dir, default_model_path)
