"""The warm-up's pass through every enabled feature's step path, before the engine serves.

The runner's warm-up runs the model's shapes (``ModelRunner._warm_up`` on the CPU, oneDNN's
row counts; ``_warm_up_gpu`` on a GPU, the Triton kernels' variants). A feature's own kernels
would otherwise first run, and on a GPU compile, inside a user's request. Here, once each:

    features         each step feature's own model path, on every rank
                     (``StepFeature.warm_up``)
    sampler          greedy rows, and rows with every sampling feature (top-k, top-p, min-p,
                     penalties, logprobs)
    features' logits each step feature's logits path (``StepFeature.warm_up_logits``: the
                     grammar masks where kernels compile, the verifier's rejection sampler at
                     every verified position and its proposing model if it has one; rank 0)

Every forward writes into the first KV blocks only, which hold nothing yet. ``warm_up_features``
returns the names of the paths it ran (what the tests check).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from services.engine.attention.metadata import build_attention_metadata
from services.engine.sampling_batch import SamplingBatch, SamplingRequest
from services.protocol.sampling_params import SamplingParams

if TYPE_CHECKING:
    from services.engine.model_runner import ModelRunner

# Every sampling feature at once: what the heaviest step's sampler runs.
EVERY_SAMPLING_FEATURE = SamplingParams(
    temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, logprobs=2, repetition_penalty=1.1,
    frequency_penalty=0.1, max_tokens=1)


@torch.inference_mode()
def warm_up_features(runner: ModelRunner, grammar_masks: bool) -> list[str]:
    """Runs each enabled feature's path once (every rank calls it: a feature's forward is a
    collective); returns the names of the paths run. ``grammar_masks``: the device compiles
    kernels on first use (a GPU), so the features' logits paths run too."""
    ran = runner.features.warm_up(runner)
    if not runner.tp.is_first:
        return ran
    rows = min(runner.config.max_num_seqs, 4)
    logits = torch.zeros(rows * runner.rows_per_seq, runner.model_config.vocab_size,
                         device=runner.device)
    ran += run_sampler(runner, logits[:rows])
    return ran + runner.features.warm_up_logits(runner, logits, grammar_masks)


def warm_up_forward(runner: ModelRunner, n: int) -> Any:
    """One forward of ``n`` prompt tokens in the first KV blocks (a feature's warm-up sets
    its own per-step state around it); returns the model's output (its hidden states)."""
    table = list(range(-(-n // runner.block_size)))
    meta, positions = build_attention_metadata([table], [n], [n], runner.block_size,
                                               runner.device)
    runner._plan(meta, n)
    ids = torch.zeros(n, dtype=torch.long, device=runner.device)
    return runner.model(ids, positions, runner.kv_caches, meta)


def sampling_batch(runner: ModelRunner, params: SamplingParams, rows: int) -> SamplingBatch:
    requests = [SamplingRequest(params, [0, 1], [1]) for _ in range(rows)]
    return SamplingBatch.from_requests(requests, runner.model_config.vocab_size, runner.device)


def run_sampler(runner: ModelRunner, logits: torch.Tensor) -> list[str]:
    rows = len(logits)
    runner.sampler(logits, sampling_batch(runner, SamplingParams(temperature=0.0), rows))
    runner.sampler(logits, sampling_batch(runner, EVERY_SAMPLING_FEATURE, rows))
    return ["sampler: greedy", "sampler: every feature"]
