"""The engine's features on a GPU, each against a reference in the same run: the checks that the
CPU suite makes, on the paths only a CUDA device takes (CUDA graphs, async scheduling, the
pinned step inputs, the features' warm-up and memory accounting).

    PYTHONPATH=. python3 benchmarks/gpu_features.py --json out.json      # about 2 min, one H200
    PYTHONPATH=. .venv/bin/python benchmarks/gpu_features.py --device cpu  # the rehearsal

The model is random (no checkpoint on a GPU machine): 4 layers of Llama, SmolLM2's vocabulary,
weights drawn wide as the suite's tiny models (``tests/conftest.py``). Everything runs in float32
so that greedy tokens are comparable exactly. Each check runs on its own, and a failure is
recorded with its traceback and the rest go on:

  graphs_async   CUDA graphs + async scheduling (the GPU defaults) == eager + sync
  ngram          prompt-lookup speculation == no speculation, drafts proposed
  self_draft     the model as its own draft (pinned staging, ``PAGODA_DRAFT_STAGING=1``):
                 equal, every draft accepted
  structured     JSON-schema and choice outputs parse and obey (the grammar masks on the device)
  profile_run    ``PAGODA_PROFILE_RUN=1``: the pool sized after a measured step; equal tokens
  host_tier      a prefix evicted from the pool comes back from pinned host memory, equal tokens
  lora           an adapter equal to peft's merged model (torch path), then with the Triton
                 shrink/expand (``PAGODA_LORA_TRITON=1``), then under graphs
                 (``PAGODA_LORA_GRAPHS=1``)
  int4           a GPTQ checkpoint through the Triton W4A16 kernel (``PAGODA_W4A16_TRITON=1``)
                 against the dequantized reference's greedy tokens
  w8a8           a compressed-tensors W8A8 checkpoint through the Triton int8 kernel
                 (``PAGODA_W8A8_TRITON=1``): the fake-quantized reference ranks every token
                 the engine chose within 0.02 of its best (rows may part at a near tie)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DIMS = {"vocab_size": 49152, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 64, "max_position_embeddings": 2048, "tie_word_embeddings": True}
NEW_TOKENS = 16


@contextlib.contextmanager
def env(**values: str) -> Iterator[None]:
    """Sets environment switches for one engine's build (they are read when it is built)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def prompts(n: int, seed: int, low: int = 100, high: int = 4000) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(rng.randint(5, 200))] for _ in range(n)]


def repetitive(n: int, seed: int) -> list[list[int]]:
    """Prompts of a repeated motif, longer than the suite's ``repetitive_prompts``: prompt
    lookup keeps finding drafts in them for several steps of a random model."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(100, 4000) for _ in range(rng.randint(2, 6))]
        out.append((motif * 20)[: rng.randint(12, 60)])
    return out


def greedy_params(n: int = NEW_TOKENS) -> Any:
    from services.engine import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def generate(llm: Any, work: list[list[int]], params: Any = None, **kw: Any) -> list[list[int]]:
    outs = llm.generate(work, params or greedy_params(), use_tqdm=False, **kw)
    return [list(o.outputs[0].token_ids) for o in outs]


class Checks:
    def __init__(self, model: Path, device: str, tmp: Path) -> None:
        self.model, self.device, self.tmp = model, device, tmp

    @contextlib.contextmanager
    def llm(self, model: Path | None = None, **kw: Any) -> Iterator[Any]:
        """An engine, shut down and its memory given back to the device after (the next
        engine sizes its pool from free memory)."""
        import gc

        import torch

        from services.engine import LLM

        args = {"dtype": "float32", "device": self.device, "max_num_seqs": 16,
                "kv_cache_memory": 256 * 1024**2, **kw}
        if "num_blocks" in args:
            args.pop("kv_cache_memory")
        llm = LLM(str(model or self.model), **args)
        try:
            yield llm
        finally:
            llm.shutdown()
            del llm
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def graphs_async(self) -> dict[str, Any]:
        work = prompts(13, seed=1)
        with self.llm() as llm:
            fast = generate(llm, work)
            graphs = llm.engine.runner.graphs is not None
        with self.llm(enforce_eager=True, async_scheduling=False) as llm:
            slow = generate(llm, work)
        return {"ok": fast == slow, "graphs": graphs, "equal_rows": sum(
            a == b for a, b in zip(fast, slow, strict=True)), "rows": len(work)}

    def _speculation(self, spec: dict[str, Any], work: list[list[int]]) -> dict[str, Any]:
        with self.llm() as llm:
            want = generate(llm, work)
        with self.llm(speculative_config=spec) as llm:
            got = generate(llm, work)
            stats = llm.engine.stats().spec_decode
        return {"equal": got == want, "drafts": stats.num_drafts,
                "draft_tokens": stats.num_draft_tokens, "accepted": stats.num_accepted_tokens}

    def ngram(self) -> dict[str, Any]:
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                "prompt_lookup_max": 3}
        r = self._speculation(spec, repetitive(8, seed=2))
        return {"ok": r["equal"] and r["drafts"] > 0, **r}

    def self_draft(self) -> dict[str, Any]:
        spec = {"method": "draft_model", "model": str(self.model), "num_speculative_tokens": 3}
        with env(PAGODA_DRAFT_STAGING="1"):
            r = self._speculation(spec, prompts(6, seed=3))
        return {"ok": r["equal"] and r["drafts"] > 0 and r["accepted"] == r["draft_tokens"],
                **r}

    def structured(self) -> dict[str, Any]:
        from services.engine import SamplingParams
        from services.protocol.structured_outputs import StructuredOutputsParams as SO

        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                   "n": {"type": "integer"}},
                  "required": ["name", "n"], "additionalProperties": False}
        specs = [SO(json=schema), SO(choice=["yes", "no", "maybe"]), None]
        params = [SamplingParams(max_tokens=60, temperature=t, seed=i,
                                 structured_outputs=specs[i % 3])
                  for i, t in enumerate([0.0, 0.0, 0.0, 1.0, 1.0, 1.0])]
        with self.llm() as llm:
            outs = llm.generate(prompts(6, seed=4), params, use_tqdm=False)
        texts, bad = [o.outputs[0].text for o in outs], []
        for i, text in enumerate(texts):
            if i % 3 == 0:
                try:
                    value = json.loads(text)
                    if set(value) != {"name", "n"} or not isinstance(value["n"], int):
                        bad.append(i)
                except ValueError:
                    bad.append(i)
            elif i % 3 == 1 and text not in ("yes", "no", "maybe"):
                bad.append(i)
        return {"ok": not bad, "bad": bad, "texts": texts}

    def profile_run(self) -> dict[str, Any]:
        work = prompts(8, seed=5)
        with self.llm(kv_cache_memory=None) as llm:
            want, blocks = generate(llm, work), llm.engine.runner.num_blocks
        with env(PAGODA_PROFILE_RUN="1"), self.llm(kv_cache_memory=None) as llm:
            got, profiled = generate(llm, work), llm.engine.runner.num_blocks
        return {"ok": got == want and profiled > 0, "blocks": blocks,
                "blocks_profiled": profiled, "ratio": round(profiled / blocks, 4)}

    def host_tier(self) -> dict[str, Any]:
        bs = 16
        a = [1000 + (i * 7) % 900 for i in range(6 * bs + 5)]
        with self.llm(num_blocks=24, block_size=bs, max_num_seqs=4,
                      kv_offloading_size=0.01) as llm:
            first = generate(llm, [a])
            for k in range(4):  # 4 x 7 blocks through 24: A's blocks leave the pool
                generate(llm, [[3000 + 1000 * k + (i * 7) % 900 for i in range(6 * bs + 9)]])
            out = llm.generate([a], greedy_params(), use_tqdm=False)[0]
            tiers = llm.engine.stats().kv_tiers
        return {"ok": list(out.outputs[0].token_ids) == first[0]
                and out.num_cached_tokens == 6 * bs,
                "cached": out.num_cached_tokens, "host_hits": tiers.host_hit_tokens}

    def lora(self) -> dict[str, Any]:
        from services.engine.lora.request import LoRARequest
        from tests.support.lora import greedy, reference, write_adapter

        adapter = write_adapter(self.model, self.tmp / "adapter", seed=11)
        merged = reference(self.model, adapter)
        work = prompts(3, seed=6)
        want = [greedy(merged, p, NEW_TOKENS)[0] for p in work]
        result: dict[str, Any] = {}
        for name, switches in (("torch", {}), ("triton", {"PAGODA_LORA_TRITON": "1"}),
                               ("graphs", {"PAGODA_LORA_GRAPHS": "1"})):
            with env(**switches), self.llm(enable_lora=True, max_lora_rank=8) as llm:
                got = generate(llm, work, lora_request=LoRARequest("a", 1, str(adapter)))
                base = generate(llm, work[:1])
            result[name] = {"equal": got == want, "base_differs": base[0] != got[0]}
        result["ok"] = all(r["equal"] and r["base_differs"] for r in result.values())
        return result

    def int4(self) -> dict[str, Any]:
        from tests.support.lora import greedy
        from tests.support.quantized import int4_reference, write_int4

        quantized, dense = write_int4(self.model, self.tmp / "gptq", "gptq", 32)
        work = prompts(3, seed=7)
        ref = int4_reference(self.model, dense)
        want = [greedy(ref, p, NEW_TOKENS)[0] for p in work]
        result: dict[str, Any] = {}
        for name, switches in (("default", {}), ("triton", {"PAGODA_W4A16_TRITON": "1"})):
            with env(**switches), self.llm(quantized) as llm:
                got = generate(llm, work)
            result[name] = {"equal_rows": sum(a == b for a, b in zip(got, want, strict=True)),
                            "rows": len(work)}
        result["ok"] = result["triton"]["equal_rows"] == len(work)
        return result


    def w8a8(self) -> dict[str, Any]:
        from tests.conftest import _write_tiny_model
        from tests.support.lora import greedy
        from tests.support.quantized import w8a8_reference, write_w8a8

        # The suite's own tiny shape (vocabulary 256), where its CPU test matches exactly:
        # per-token activation scales make near-ties of a wider random model flip either way.
        small = self.tmp / "small"
        _write_tiny_model(small, "LlamaForCausalLM", 0, {})
        quantized = write_w8a8(small, self.tmp / "w8a8")
        work = prompts(3, seed=8, low=3, high=250)
        reference = w8a8_reference(small, quantized)
        want = [greedy(reference, p, NEW_TOKENS)[0] for p in work]
        from tests.support.spec_decode import engine, run

        with env(PAGODA_W8A8_TRITON="1"):  # the engine alone: this model has no tokenizer
            core = engine(quantized, device=self.device, dtype="float32", num_blocks=64)
        try:
            got = run(core, work, greedy_params())
        finally:
            core.close()
        equal = sum(a == b for a, b in zip(got, want, strict=True))
        # Rows may part at a near tie (per-token activation scales round either way): the
        # reference, fed the engine's tokens, must rank each of them within a hair of its best.
        gap = max(choice_gap(reference, p, g) for p, g in zip(work, got, strict=True))
        return {"ok": gap < 0.02, "equal_rows": equal, "rows": len(work),
                "max_logprob_gap": gap}


def choice_gap(model: Any, prompt: list[int], tokens: list[int]) -> float:
    """The most that ``model``'s best next-token logprob exceeds the one of the token chosen,
    over a continuation (0: every choice was its greedy one)."""
    import torch

    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return (logprobs.max(dim=-1).values - chosen).max().item()


CHECKS = ("graphs_async", "ngram", "self_draft", "structured", "profile_run", "host_tier",
          "lora", "int4", "w8a8")


def make_model(out: Path) -> Path:
    from tests.conftest import _write_tiny_model

    _write_tiny_model(out, "LlamaForCausalLM", 3, DIMS)
    tokenizer = REPO / ".gpu_assets" / "smollm2-tokenizer"
    if not tokenizer.exists():
        from services.engine.models.default import default_model_path

        tokenizer = default_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer / name).exists():
            (out / name).write_bytes((tokenizer / name).read_bytes())
    return out


def run(names: list[str], device: str, report: Callable[[dict[str, Any]], None]) -> dict:
    results: dict[str, Any] = {"device": device, "checks": {}}
    with tempfile.TemporaryDirectory(prefix="pagoda-gpu-features-") as d:
        tmp = Path(d)
        checks = Checks(make_model(tmp / "model"), device, tmp)
        for name in names:
            start = time.monotonic()
            try:
                r = getattr(checks, name)()
            except Exception as exc:  # noqa: BLE001 -- recorded, the other checks go on
                r = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:1500],
                     "traceback": traceback.format_exc()[-4000:]}
            r["seconds"] = round(time.monotonic() - start, 1)
            results["checks"][name] = r
            print(f"{'PASS' if r['ok'] else 'FAIL'} {name} ({r['seconds']}s) "
                  f"{json.dumps({k: v for k, v in r.items() if k not in ('traceback', 'texts')})}",
                  flush=True)
            report(results)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--checks", default=",".join(CHECKS))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    names = [c for c in args.checks.split(",") if c]
    unknown = set(names) - set(CHECKS)
    if unknown:
        raise SystemExit(f"unknown checks {sorted(unknown)}; known: {', '.join(CHECKS)}")

    def report(results: dict[str, Any]) -> None:
        if args.json is not None:
            args.json.write_text(json.dumps(results, indent=1, default=str))

    results = run(names, args.device, report)
    failed = [n for n, r in results["checks"].items() if not r["ok"]]
    print(f"{len(names) - len(failed)}/{len(names)} passed" + (f"; failed: {failed}"
                                                                 if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
