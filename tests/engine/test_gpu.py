"""The GPU path, where CUDA is present (``make test-gpu``): CUDA graphs change no token, greedy
fp32 equals transformers token for token, and a fresh engine is warm before its first step.

The model is random (made here: a GPU machine may have no checkpoint), 4 layers of Llama with
SmolLM2's vocabulary; the tokenizer files come from ``$PAGODA_TOKENIZER_DIR``, else
``.gpu_assets/smollm2-tokenizer`` in the repository, else the default model's directory.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "vocab.json", "merges.txt")
_DIMS = {"vocab_size": 49152, "hidden_size": 256, "intermediate_size": 512,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
         "head_dim": 64, "max_position_embeddings": 2048, "tie_word_embeddings": True}


def _tokenizer_dir() -> Path:
    for candidate in (os.environ.get("PAGODA_TOKENIZER_DIR"),
                      Path(__file__).resolve().parents[2] / ".gpu_assets" / "smollm2-tokenizer"):
        if candidate and (Path(candidate) / "tokenizer.json").exists():
            return Path(candidate)
    from services.engine.models.default import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def gpu_model_dir(tiny_model_dir) -> Path:
    out = tiny_model_dir("LlamaForCausalLM", seed=3, **_DIMS)
    for name in _TOKENIZER_FILES:
        src = _tokenizer_dir() / name
        if src.exists() and not (out / name).exists():
            shutil.copy(src, out / name)
    return out


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randint(3, 300))] for _ in range(n)]


def _greedy(llm, prompts, max_tokens: int = 40) -> list[list[int]]:
    from services.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_cuda_graphs_change_no_token_bf16(gpu_model_dir: Path) -> None:
    """bf16 with graphs equals bf16 eager token for token: batch sizes that pad to their
    bucket (13 requests, then fewer as they finish), prefix-cache hits, chunked prefill."""
    from services.engine import LLM

    kwargs = {"dtype": "bfloat16", "max_num_seqs": 16, "max_num_batched_tokens": 256,
                  "kv_cache_memory": 256 * 1024**2}
    prompts = _prompts(13, seed=1)
    prompts += [p[:150] + [7, 8, 9] for p in prompts[:3] if len(p) > 150]  # shared prefixes
    graphs = LLM(str(gpu_model_dir), **kwargs)
    assert graphs.engine.runner.graphs is not None
    with_graphs = _greedy(graphs, prompts)
    del graphs
    eager = LLM(str(gpu_model_dir), enforce_eager=True, **kwargs)
    assert eager.engine.runner.graphs is None
    assert with_graphs == _greedy(eager, prompts)


def test_greedy_fp32_equals_transformers(gpu_model_dir: Path) -> None:
    import transformers

    from services.engine import LLM

    prompts = _prompts(8, seed=2)
    llm = LLM(str(gpu_model_dir), dtype="float32", max_num_seqs=8,
              kv_cache_memory=256 * 1024**2)
    got = _greedy(llm, prompts, max_tokens=24)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        gpu_model_dir, dtype=torch.float32, attn_implementation="eager").cuda().eval()
    ref.generation_config.eos_token_id = None  # as ignore_eos: run the full length
    for prompt, tokens in zip(prompts, got, strict=True):
        ids = torch.tensor([prompt], device="cuda")
        out = ref.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == tokens


def test_a_fresh_engine_is_compiled_and_captured_before_its_first_step(gpu_model_dir) -> None:
    """The first generate of a fresh engine builds no kernel variant: every one it meets was
    compiled and every graph captured at start (no cold start for a pod added under load)."""
    import triton

    from services.engine import LLM

    llm = LLM(str(gpu_model_dir), dtype="bfloat16", max_num_seqs=32,
              max_num_batched_tokens=512, kv_cache_memory=256 * 1024**2)
    built: list[str] = []

    def record(*, fn, **_kwargs) -> None:  # called by Triton before it compiles a variant
        built.append(fn.name)

    triton.knobs.runtime.jit_cache_hook = record
    try:
        _greedy(llm, _prompts(24, seed=4), max_tokens=20)
        _greedy(llm, _prompts(3, seed=5) + [list(range(100, 600))], max_tokens=5)
    finally:
        triton.knobs.runtime.jit_cache_hook = None
    assert built == [], f"kernel variants compiled during the run: {built}"
