"""Speculative decoding's checks, shared by the tests (a few prompts) and
``benchmarks/spec_decode_equality.py`` (all of them): prompts that repeat themselves, engine
runs, and transformers' own speculative generation as the reference."""

from __future__ import annotations

import random
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.protocol.sampling_params import SamplingParams

NUM_PROMPTS = 20
NEW_TOKENS = 64
K = 3  # num_speculative_tokens

# The default model: texts that copy from themselves (prompt lookup's case) and plain chat.
TEXTS = [
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef add_three(a, b, c):\n    return add(add(a, b),",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday, Tuesday,",
    "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is",
    "To be, or not to be, that is the question. To be, or not",
    "apple banana cherry apple banana cherry apple banana",
    "SELECT name FROM users WHERE id = 1; SELECT name FROM users WHERE id = 2; SELECT",
    "Kubernetes schedules pods onto nodes. Kubernetes schedules",
    "Once upon a time there was a king. Once upon a time there was a queen. Once upon a",
    "red, green, blue, red, green, blue, red,",
    "<li>one</li>\n<li>two</li>\n<li>three</li>\n<li>",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "Q: What is 2 + 2? A: 4. Q: What is 3 + 3? A: 6. Q: What is 4 + 4? A:",
    "The mitochondria is the powerhouse of the cell. The mitochondria",
    "import numpy as np\nimport torch\nimport numpy as np\nimport",
    "{\"name\": \"Ann\", \"age\": 3}, {\"name\": \"Bob\", \"age\": 4}, {\"name\":",
    "Translate to French: good morning. Bonjour. Translate to French: good night.",
    "a b c d e f g a b c d e f g a b c",
]


def repetitive_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of a few random tokens repeated (so prompt lookup finds drafts)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        motif = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 7))]
        out.append((motif * 12)[: rng.randint(8, 48)])
    return out


def greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    """Greedy, EOS not ending the request (transformers: ``eos_token_id=None``)."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run(engine: LLMEngine, prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams]) -> list[list[int]]:
    """Every prompt to completion, all at once; their output tokens."""
    many = params if isinstance(params, Sequence) else [params] * len(prompts)
    requests = [engine.add_request(f"q{i}", list(p), sp)
                for i, (p, sp) in enumerate(zip(prompts, many, strict=True))]
    while engine.has_unfinished_requests():
        engine.step()
    return [list(r.output_token_ids) for r in requests]


def engine(model: Path | str, spec: dict[str, Any] | None = None, **config: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), speculative_config=spec, **config))


def ngram(k: int = K, **extra: Any) -> dict[str, Any]:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, **extra}


def draft(path: Path | str, k: int = K, **extra: Any) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k, **extra}


def hf_speculative(target: Path | str, prompts: Sequence[Sequence[int]], spec: dict[str, Any],
                   max_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """transformers' greedy speculative generation: ``prompt_lookup_num_tokens`` for ngram,
    ``assistant_model`` for a draft model (no EOS: the engine runs with ignore_eos)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    kwargs: dict[str, Any] = {}
    if spec["method"] == "ngram":
        kwargs["prompt_lookup_num_tokens"] = spec["num_speculative_tokens"]
    else:
        assistant = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
        assistant.generation_config.num_assistant_tokens = spec["num_speculative_tokens"]
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        kwargs["assistant_model"] = assistant
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([list(p)])
            got = model.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, **kwargs)
            out.append(got[0, len(p):].tolist())
    return out


def random_draft_like(target: Path, out: Path, seed: int = 1) -> Path:
    """A deliberately bad draft for ``target``: a tiny random Llama with its vocabulary and
    context, and its tokenizer files."""
    from services.common.model_files import ModelFiles
    from tests.conftest import _write_tiny_model

    if (out / "config.json").is_file():
        return out
    cfg = ModelFiles.read(target).config
    _write_tiny_model(out, "LlamaForCausalLM", seed, {
        "vocab_size": cfg["vocab_size"],
        "max_position_embeddings": cfg["max_position_embeddings"],
        "tie_word_embeddings": True,
    })
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (target / name).is_file():
            shutil.copy(target / name, out / name)
    return out
