"""Greedy equality of speculative decoding, in full (issue 26): 20 prompts x 64 tokens, fp32, on
a tiny random model and on the default model, with prompt lookup, a deliberately bad draft (a
random model of the same vocabulary) and the target as its own draft; the outputs must equal
speculation off and transformers' own speculative generation (``prompt_lookup_num_tokens`` /
``assistant_model``), and the self-draft must have every draft accepted.

    .venv/bin/python benchmarks/spec_decode_equality.py [--models tiny,default]

``make test`` runs the same checks on fewer prompts (tests/engine/test_spec_decode*.py). Exits
non-zero on any difference.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from tests.conftest import _write_tiny_model
from tests.support import spec_decode as sd


def check(name: str, target: Path, bad_draft: Path, prompts: list[list[int]]) -> bool:
    eng = sd.engine(target, num_blocks=1024, max_num_seqs=32)
    want = sd.run(eng, prompts, sd.greedy())
    eng.close()
    ok = True
    for kind, spec in (("ngram", sd.ngram()), ("bad draft", sd.draft(bad_draft)),
                       ("self draft", sd.draft(target))):
        start = time.perf_counter()
        eng = sd.engine(target, spec, num_blocks=1024, max_num_seqs=32)
        got = sd.run(eng, prompts, sd.greedy())
        stats = eng.stats().spec_decode
        eng.close()
        hf = sd.hf_speculative(target, prompts, spec)
        same = got == want
        same_hf = hf == want
        all_accepted = kind != "self draft" or stats.num_accepted_tokens == stats.num_draft_tokens
        ok &= same and same_hf and all_accepted
        print(f"{name:8} {kind:10} equal to speculation off: {same}  to transformers: {same_hf}"
              f"  drafts {stats.num_draft_tokens} accepted {stats.num_accepted_tokens}"
              f"{'' if all_accepted else '  (NOT all accepted)'}"
              f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,default")
    args = ap.parse_args()
    ok = True
    with tempfile.TemporaryDirectory() as d:
        if "tiny" in args.models:
            target, bad = Path(d, "tiny"), Path(d, "tiny-bad")
            _write_tiny_model(target, "LlamaForCausalLM", 0, {})
            _write_tiny_model(bad, "LlamaForCausalLM", 1, {})
            ok &= check("tiny", target, bad, sd.repetitive_prompts(sd.NUM_PROMPTS, 256))
        if "default" in args.models:
            from services.engine.models.default import default_model_path
            from services.text.tokenizer import Tokenizer

            target = default_model_path()
            bad = sd.random_draft_like(target, Path(d, "default-bad"))
            tok = Tokenizer(str(target))
            ok &= check("default", target, bad, [tok.encode(t) for t in sd.TEXTS])
    print("all equal" if ok else "DIFFERENCES FOUND")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
