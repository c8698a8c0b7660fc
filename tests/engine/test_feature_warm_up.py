"""The warm-up runs every enabled feature's step path (``feature_warm_up``), and only those.

An engine with LoRA slots and a draft model warms the LoRA layout, the sampler's paths, the
verification and the draft model; one without warms the sampler alone; the grammar masks (a
GPU's warm-up) run here too when asked, leaving the logits as they were. The first requests
after it give the tokens of an engine that warmed nothing of it.
"""

from __future__ import annotations

import torch

from services.engine import feature_warm_up
from services.protocol.sampling_params import SamplingParams
from tests.support import spec_decode as sd

SMALL = {"num_blocks": 64, "max_num_seqs": 8, "max_num_batched_tokens": 32}
SAMPLER = ["sampler: greedy", "sampler: every feature"]


def test_every_enabled_feature_is_warmed_and_no_other(tiny_model_dir, monkeypatch) -> None:
    target = tiny_model_dir("LlamaForCausalLM")
    calls = []
    real_verify = feature_warm_up.spec_step.verify
    monkeypatch.setattr(feature_warm_up.spec_step, "verify",
                        lambda *a: calls.append("verify") or real_verify(*a))
    plain = sd.engine(target, **SMALL)
    try:
        assert plain.runner.warmed_up == SAMPLER
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        expected = sd.run(plain, [[1, 2, 3]], params)
    finally:
        plain.close()
    assert calls == []
    engine = sd.engine(target, sd.draft(target), enable_lora=True, max_loras=2, **SMALL)
    try:
        runner = engine.runner
        assert runner.warmed_up == ["LoRA layout", *SAMPLER, "verification", "draft model"]
        assert calls == ["verify"]
        assert runner.lora.state.step is None  # the warm-up's layout is gone
        again = feature_warm_up.warm_up_features(runner, grammar_masks=True)
        assert again[-1] == "grammar masks" and runner.masker is not None
        logits = torch.randn(3, runner.model_config.vocab_size)
        before = logits.clone()
        runner.masker.mask(logits, [0, 1, 2])  # the bitmask the warm-up left: all allowed
        assert torch.equal(logits, before)
        assert sd.run(engine, [[1, 2, 3]], params) == expected
    finally:
        engine.close()
