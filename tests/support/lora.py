"""LoRA adapters for tests, made with ``peft`` itself, and transformers + peft references.

``write_adapter`` trains nothing: ``init_lora_weights=False`` gives random, non-zero A and B
(so every adapter visibly changes the model), saved in PEFT's own format. ``reference`` is the
same adapter merged into the base model by ``merge_and_unload()``: what the engine's output is
compared with, token for token and logprob for logprob.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

DENSE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PHI3_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def write_adapter(base: Path, out: Path, *, seed: int, r: int = 8, alpha: float = 16,
                  rslora: bool = False, targets: Sequence[str] = DENSE_TARGETS,
                  **config: Any) -> Path:
    """Saves a random PEFT LoRA adapter of the HF model at ``base`` in ``out``."""
    import transformers
    from peft import LoraConfig, get_peft_model

    if (out / "adapter_config.json").exists():
        return out
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(
        r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=list(targets),
        init_lora_weights=False, **config))
    peft_model.save_pretrained(out)
    return out


def reference(base: Path, adapter: Path | None) -> torch.nn.Module:
    """transformers' model of ``base`` with ``adapter`` merged (``merge_and_unload``), fp32."""
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return model.eval()


@torch.inference_mode()
def greedy(model: torch.nn.Module, prompt: Sequence[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of ``prompt`` (n tokens, EOS ignored) and each chosen
    token's logprob under the raw distribution."""
    ids = torch.tensor([list(prompt)])
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    logits = model(out).logits[0, len(prompt) - 1 : -1].float()
    lps = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return tokens, lps.tolist()


def edit_config(adapter: Path, out: Path, **changes: Any) -> Path:
    """A copy of ``adapter`` whose adapter_config.json has ``changes``."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config.update(changes)
    (out / "adapter_config.json").write_text(json.dumps(config))
    (out / "adapter_model.safetensors").write_bytes(
        (adapter / "adapter_model.safetensors").read_bytes())
    return out
