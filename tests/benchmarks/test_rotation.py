"""benchmarks/rotation.py: the rotated model computes the original's logits (transformers and
Pagoda's engine), its Hadamard matrices are Hadamard, and the rotation really moved the weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.rotation import hadamard, random_orthogonal, rotate_llama, save_rotated

# 72 = 2 * 36 (Paley II, q = 17, as in 576 = 16 * 36), head_dim 12 (Paley I, q = 11); GQA, 6
# query heads over 2 KV heads; tied embeddings, as the default model's.
SHAPE = {
    "hidden_size": 72,
    "intermediate_size": 96,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 12,
    "tie_word_embeddings": True,
}


@pytest.mark.parametrize("n", [2, 12, 36, 64, 72, 576])
def test_hadamard(n: int) -> None:
    h = hadamard(n)
    assert h is not None and set(h.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h @ h.t(), n * torch.eye(n, dtype=torch.float64))


def test_random_orthogonal_without_hadamard() -> None:
    assert hadamard(100) is None
    q = random_orthogonal(100, torch.Generator().manual_seed(0))
    assert torch.allclose(q @ q.t(), torch.eye(100, dtype=torch.float64), atol=1e-12)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> Path:
    return tiny_model_dir("LlamaForCausalLM", seed=3, **SHAPE)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits[0]


@pytest.mark.parametrize("kind", ["hadamard", "gaussian"])
def test_rotated_logits_equal_the_original(tiny: Path, kind: str) -> None:
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    original = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    rotated = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    rotate_llama(rotated, seed=0, kind=kind)
    want, got = _logits(original, ids), _logits(rotated, ids)
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()
    # Not the identity: every weight moved, the norms are ones, the head is its own tensor.
    a, b = original.model.layers[1], rotated.model.layers[1]
    for name in ("self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj"):
        wa, wb = a.get_submodule(name).weight, b.get_submodule(name).weight
        assert (wa - wb).abs().max() > 0.1 * wa.abs().max(), name
    assert torch.equal(b.input_layernorm.weight, torch.ones(72))
    assert rotated.lm_head.weight is not rotated.model.embed_tokens.weight
    assert not rotated.config.tie_word_embeddings


def test_pagoda_serves_the_rotated_checkpoint(tiny: Path, tmp_path: Path) -> None:
    """Written untied (``lm_head.weight`` of its own), Pagoda's loader gives the same logits."""
    import json

    from services.engine.models.loader import load_model
    from tests.engine.test_models import _step

    out = save_rotated(tiny, tmp_path / "rotated")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    logits = []
    for path in (tiny, out):
        model = load_model(path, dtype=torch.float32)
        cfg = model.config
        kv = [
            tuple(torch.zeros(3, 16, cfg.num_kv_heads, cfg.head_dim) for _ in range(2))
            for _ in range(cfg.num_layers)
        ]
        logits.append(_step(model, kv, [ids], [0], [len(ids)], [[0, 1, 2]])[0])
    assert (logits[1] - logits[0]).abs().max().item() < 1e-4 * logits[0].abs().max().item()
