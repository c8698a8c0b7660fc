"""Pipeline parallelism on the CPU (gloo): P stages (x T tensor-parallel ranks each) must
generate exactly one rank's greedy tokens.

The layer split follows vLLM's rule; a stage loads only its layers' weights and holds only their
KV; the default model over 2 stages and tiny models of several families over 2 stages and
2 x 2 ranks (an uneven 3-layer split with a tied head over 2 x 2, Gemma's scaled embedding and
soft-caps, experts) give one rank's greedy tokens while the engine keeps two batches in flight.
The LWS environment path and a killed stage are in ``test_node_group.py``.
"""

from __future__ import annotations

import pytest
import torch

from services.engine import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.models.loader import load_model
from services.engine.models.pipeline_stage import MissingLayer, layer_ranges, stage_of
from services.engine.parallel.pipeline import PipelineRank, check_payload, payload_limit
from services.engine.parallel.step_broadcast import StepBatch, encode

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41], [7] * 11,
           [100, 7, 9, 13]]


def test_layers_split_by_vllms_rule() -> None:
    """An uneven remainder goes to the stages before the last, from the second-to-last back."""
    assert layer_ranges(4, 2) == [(0, 2), (2, 4)]
    assert layer_ranges(5, 2) == [(0, 3), (3, 5)]
    assert layer_ranges(10, 4) == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert layer_ranges(30, 4) == [(0, 7), (7, 15), (15, 23), (23, 30)]
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        layer_ranges(2, 3)


def test_rank_zeros_group_runs_the_last_stage() -> None:
    """Rank 0 samples, so its tensor-parallel group is the last stage; each rank hands on to
    the next stage's rank of its own tensor-parallel index."""
    ranks = [PipelineRank(r, 2, 2) for r in range(4)]
    assert [(p.stage, p.tp_rank) for p in ranks] == [(1, 0), (1, 1), (0, 0), (0, 1)]
    assert [p.next for p in ranks] == [None, None, 0, 1]
    assert [p.prev for p in ranks] == [2, 3, 0, 0]
    three = [PipelineRank(r, 3, 1) for r in range(3)]
    assert [(p.stage, p.prev, p.next) for p in three] == [(2, 2, None), (0, 0, 2), (1, 1, 0)]


def test_a_step_bigger_than_the_engines_limits_is_refused() -> None:
    """A peer's header is checked before anything is allocated for it: the biggest step the
    limits allow fits (4 tokens, 2 requests of 3 blocks, prompt logprobs), one word more not."""
    limit = payload_limit(max_tokens=4, max_seqs=2, max_blocks=3)
    biggest = StepBatch.of([1, 2, 3, 4], [[0, 1, 2], [3, 4, 5]], [12, 12], [2, 2], [0, 1],
                           [0, 2, 2, 2])
    check_payload(len(encode(biggest)), limit)
    with pytest.raises(RuntimeError, match="announced a step of"):
        check_payload(limit + 1, limit)


def test_a_stage_loads_only_its_layers(tiny_model_dir) -> None:
    path = tiny_model_dir("LlamaForCausalLM", num_hidden_layers=3, tie_word_embeddings=True)
    first = load_model(path, stage=stage_of(3, 0, 2))
    last = load_model(path, stage=stage_of(3, 1, 2))
    assert len(first.model.layers) == 2 and len(last.model.layers) == 1
    assert isinstance(first.model.norm, MissingLayer) and isinstance(first.lm_head, MissingLayer)
    assert not isinstance(last.model.embed_tokens, MissingLayer)  # the tied head's weight
    whole = load_model(path)
    count = {n: len(dict(m.named_parameters())) for n, m in (("first", first), ("last", last))}
    # the tied embedding on both: stage 0 looks tokens up, the last stage is its LM head
    assert count["first"] + count["last"] == len(dict(whole.named_parameters())) + 1
    for mine, theirs in ((first.model.layers[1], whole.model.layers[1]),
                         (last.model.layers[0], whole.model.layers[2])):
        assert torch.equal(mine.mlp.down_proj.weight, theirs.mlp.down_proj.weight)


def test_unsupported_combinations_are_refused() -> None:
    with pytest.raises(ValueError, match="enable_lora is not supported with pipeline"):
        EngineConfig(pipeline_parallel_size=2, enable_lora=True, device="cpu")
    with pytest.raises(ValueError, match="pipeline_parallel_size must be positive|positive"):
        EngineConfig(pipeline_parallel_size=0, device="cpu")


def _greedy(path, prompts: list[list[int]] = PROMPTS, max_tokens: int = 5,
            **kwargs) -> tuple[list[list[int]], int]:
    """Every prompt's greedy tokens, and the most steps the engine had in flight."""
    engine = LLMEngine(EngineConfig(model=str(path), num_blocks=64, block_size=4,
                                    max_num_seqs=8, device="cpu", **kwargs))
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        for i, ids in enumerate(prompts):
            engine.add_request(f"r{i}", ids, params)
        out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished_requests():
            for update in engine.step():
                out[update.request_id].extend(update.new_token_ids)
        peak = 0 if engine.batches is None else engine.batches.peak
    finally:
        engine.close()
    return [out[f"r{i}"] for i in range(len(prompts))], peak


# (id, architecture, overrides, pipeline stages, tensor-parallel ranks per stage)
LAYOUTS = [
    # 3 layers as 2 + 1, the tied head on the last stage, each stage over 2 ranks
    ("llama-3-layers-tied-pp2-tp2", "LlamaForCausalLM",
     {"num_hidden_layers": 3, "tie_word_embeddings": True}, 2, 2),
    ("gemma2-pp2", "Gemma2ForCausalLM",
     {"sliding_window": 6, "attn_logit_softcapping": 1.5, "final_logit_softcapping": 3.0}, 2, 1),
    ("qwen3-moe-pp2", "Qwen3MoeForCausalLM",
     {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
      "norm_topk_prob": True, "mlp_only_layers": [1], "tie_word_embeddings": False}, 2, 1),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=[lay[0] for lay in LAYOUTS])
def test_stages_generate_one_ranks_greedy_tokens(tiny_model_dir, layout) -> None:
    _, architecture, overrides, pp, tp = layout
    path = tiny_model_dir(architecture, **overrides)
    one, _ = _greedy(path)
    staged, peak = _greedy(path, pipeline_parallel_size=pp, tensor_parallel_size=tp)
    assert staged == one
    assert peak == pp  # the stages had a batch each in flight


def test_default_model_over_two_stages(default_model_path) -> None:
    """SmolLM2-135M's 30 layers as 15 + 15: short prompts, a few tokens."""
    one, _ = _greedy(default_model_path, dtype="float32", prompts=PROMPTS[:3], max_tokens=3)
    two, peak = _greedy(default_model_path, dtype="float32", prompts=PROMPTS[:3], max_tokens=3,
                        pipeline_parallel_size=2)
    assert two == one and peak == 2
