"""LoRA adapters for tests, made with ``peft`` itself, and transformers + peft references.

``write_adapter`` trains nothing: ``init_lora_weights=False`` gives random, non-zero A and B
(so every adapter visibly changes the model), saved in PEFT's own format. ``reference`` is the
same adapter merged into the base model by ``merge_and_unload()``: what the engine's output is
compared with, token for token and logprob for logprob.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
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


WEIGHTS_FILE, CONFIG_FILE = "adapter_model.safetensors", "adapter_config.json"
# Each hostile adapter under ``hostile_root``'s root, and words of the 400 it must get.
HOSTILE = {"fifo": "not a regular file", "zero": "symbolic link", "absurd": str(2**60),
           "ints": "floating point", "escape": "symbolic link", "../outside/secret": "'..'",
           "ok/../ok": "'..'", "missing": "does not exist"}


def hostile_root(good: Path, base: Path) -> Path:
    """``base/root`` with ``ok`` (a copy of ``good``) and each of ``HOSTILE``: a symlink to
    ``base/outside/secret`` (a valid adapter) and ``add_hostile_files``'s."""
    import shutil

    root, outside = base / "root", base / "outside"
    shutil.copytree(good, root / "ok")
    shutil.copytree(good, outside / "secret")
    (root / "escape").symlink_to(outside / "secret")
    add_hostile_files(good, root)
    return root


def add_hostile_files(good: Path, root: Path) -> None:
    """In ``root``, with ``good``'s config each: ``fifo`` (a FIFO named
    adapter_model.safetensors), ``zero`` (/dev/zero behind a symlink), ``absurd`` (a header
    claiming 2**60 bytes), ``ints`` (integer tensors) and ``big`` (``good``'s weights, which a
    test grows past its cap)."""
    import shutil
    import struct

    from safetensors.torch import load_file, save_file

    for name in ("fifo", "zero", "absurd", "ints", "big"):
        (root / name).mkdir()
        shutil.copy(good / CONFIG_FILE, root / name / CONFIG_FILE)
    os.mkfifo(root / "fifo" / WEIGHTS_FILE)
    (root / "zero" / WEIGHTS_FILE).symlink_to("/dev/zero")
    (root / "absurd" / WEIGHTS_FILE).write_bytes(struct.pack("<Q", 2**60) + b"{}")
    ints = {k: (v * 100).to(torch.int32) for k, v in load_file(good / WEIGHTS_FILE).items()}
    save_file(ints, root / "ints" / WEIGHTS_FILE)
    shutil.copy(good / WEIGHTS_FILE, root / "big" / WEIGHTS_FILE)


def release_fifo(fifo: Path) -> None:
    """Ends a read stuck on ``fifo`` (old code's), if any: a writer that closes at once."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # no reader waits


def admin_post(base_url: str, route: str, body: dict, key: str) -> tuple[int, str]:
    """POST /v1/<route> (the runtime adapter routes) with ``key``: (status, body), errors too."""
    req = urllib.request.Request(
        f"{base_url}/v1/{route}", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
