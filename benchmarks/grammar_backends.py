"""xgrammar vs llguidance on this machine's CPU: what picked the structured-output backend.

    python benchmarks/grammar_backends.py [--model DIR] [--batch 64] [--steps 60]

For the default model's tokenizer it measures, per library: building the tokenizer index
(once per engine), compiling a realistic JSON schema (cold, per schema; llguidance compiles
lazily, so its first mask is counted in), and the per-step time to fill the token masks of a
whole batch of matchers that are each walking through a valid instance of that schema (what
the engine pays every decode step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "orders": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer",
                                                             "minimum": 1}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["id", "name", "email", "role", "active", "address"],
    "additionalProperties": False,
}
INSTANCE = {
    "id": 42, "name": "Ada Lovelace", "email": "ada@example.com", "role": "admin",
    "active": True, "score": 9.5, "tags": ["math", "engines"],
    "address": {"street": "12 St James Sq", "city": "London", "zip": "12345"},
    "orders": [{"sku": "AB-1", "qty": 2}, {"sku": "CD-22", "qty": 1}],
}


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - start) * 1000


def bench_xgrammar(hf, vocab: int, tokens: list[int], batch: int, steps: int) -> dict:
    import torch
    import xgrammar as xgr

    info, t_tok = _timed(lambda: xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    compiled, t_compile = _timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    for i, m in enumerate(matchers):  # spread them over the instance, as in a real batch
        for t in tokens[: i % (len(tokens) // 2)]:
            assert m.accept_token(t)
    bitmask = xgr.allocate_token_bitmask(batch, vocab)
    logits = torch.randn(batch, vocab)
    batcher = xgr.BatchGrammarMatcher()
    serial, batched, apply = [], [], []
    for step in range(steps):
        _, ms = _timed(lambda: [m.fill_next_token_bitmask(bitmask, i)
                                for i, m in enumerate(matchers)])
        serial.append(ms)
        _, ms = _timed(lambda: batcher.batch_fill_next_token_bitmask(matchers, bitmask))
        batched.append(ms)
        _, ms = _timed(lambda: xgr.apply_token_bitmask_inplace(logits, bitmask))
        apply.append(ms)
        for i, m in enumerate(matchers):
            nxt = tokens[(i % (len(tokens) // 2)) + step]
            assert m.accept_token(nxt)
    return {"tokenizer_ms": t_tok, "compile_ms": t_compile,
            "mask_serial_ms": statistics.median(serial),
            "mask_batched_ms": statistics.median(batched),
            "apply_ms": statistics.median(apply)}


def bench_llguidance(hf, vocab: int, tokens: list[int], batch: int, steps: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt
    import torch

    tok, t_tok = _timed(lambda: llguidance.hf.from_tokenizer(hf, n_vocab=vocab))

    def compile_one():
        grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
        m = llguidance.LLMatcher(tok, grammar)
        m.compute_bitmask()  # compiles lazily: the first mask is part of the cost
        return grammar

    grammar, t_compile = _timed(compile_one)
    matchers = [llguidance.LLMatcher(tok, grammar) for _ in range(batch)]
    for i, m in enumerate(matchers):
        for t in tokens[: i % (len(tokens) // 2)]:
            assert m.consume_token(t)
    bitmask = lt.allocate_token_bitmask(batch, vocab)
    logits = torch.randn(batch, vocab)
    executor = llguidance.LLExecutor()
    serial, batched, apply = [], [], []
    for step in range(steps):
        _, ms = _timed(lambda: [lt.fill_next_token_bitmask(m, bitmask, i)
                                for i, m in enumerate(matchers)])
        serial.append(ms)
        _, ms = _timed(lambda: lt.fill_next_token_bitmask_par(
            executor, [(m, i) for i, m in enumerate(matchers)], bitmask))
        batched.append(ms)
        _, ms = _timed(lambda: lt.apply_token_bitmask_inplace(logits, bitmask))
        apply.append(ms)
        for i, m in enumerate(matchers):
            assert m.consume_token(tokens[(i % (len(tokens) // 2)) + step])
    return {"tokenizer_ms": t_tok, "compile_ms": t_compile,
            "mask_serial_ms": statistics.median(serial),
            "mask_batched_ms": statistics.median(batched),
            "apply_ms": statistics.median(apply)}


def main() -> None:
    from transformers import AutoTokenizer

    from services.common.default_model import converted_default_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    model = args.model or converted_default_model()
    hf = AutoTokenizer.from_pretrained(str(model))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    tokens = hf.encode(json.dumps(INSTANCE), add_special_tokens=False)
    steps = min(args.steps, len(tokens) // 2)
    print(f"model={model.name} vocab={vocab} batch={args.batch} steps={steps} "
          f"instance_tokens={len(tokens)}")
    for name, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        r = fn(hf, vocab, tokens, args.batch, steps)
        print(f"{name:11s} tokenizer {r['tokenizer_ms']:8.1f} ms  compile {r['compile_ms']:7.1f} ms"
              f"  mask/step serial {r['mask_serial_ms']:6.2f} ms  batched "
              f"{r['mask_batched_ms']:6.2f} ms  apply {r['apply_ms']:5.2f} ms")


if __name__ == "__main__":
    main()
