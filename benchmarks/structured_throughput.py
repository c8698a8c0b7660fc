"""How much constrained requests slow the free requests that share their batch.

    python benchmarks/structured_throughput.py [--model DIR] [--batch 64] [--tokens 32]
        [--rounds 5] [--cpu-threads N]

Two workloads of the same shape through the offline engine: ``batch`` requests that each
generate exactly ``tokens`` tokens (ignore_eos). In "free" none is constrained; in "mixed"
half of them follow a JSON schema whose grammar stays open for the whole run (a string of at
least 2,000 characters), so every step fills and applies half a batch of token masks. Every
request runs the same number of steps either way, so a free request's decode rate is
``tokens / wall``; the drop is how much slower the mixed run is. Rounds alternate
(free, mixed, free, ...); the fastest round of each is compared (the one a busy shared machine
disturbed least), the medians are shown too. The time spent in the structured-output code
itself (filling and applying masks, advancing matchers) is also measured directly, as a share
of the mixed run's wall time: that share does not depend on what else the machine runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

from services.engine.llm import LLM
from services.engine.structured import masks
from services.protocol.sampling_params import SamplingParams
from services.protocol.structured_outputs import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 2000}},
          "required": ["text"]}


def run(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == params[0].max_tokens for o in outs)
    return wall


class _Clock:
    """Wall time spent inside the structured-output hooks (instrumented here, not in the
    engine)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for cls, name in ((masks.TokenMasker, "apply"), (masks.GrammarState, "accept")):
            setattr(cls, name, self._timed(getattr(cls, name)))

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model directory (default model if unset)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cpu-threads", type=int, default=None,
                    help="engine threads (1 keeps a shared machine's noise down)")
    args = ap.parse_args()
    llm = LLM(args.model, max_num_seqs=args.batch, cpu_threads=args.cpu_threads)
    prompts = [f"Request {i}: write a long story about the number {i}." for i in range(args.batch)]
    free = SamplingParams(max_tokens=args.tokens, temperature=0.8, seed=1, ignore_eos=True)
    spec = StructuredOutputsParams(json=SCHEMA)
    constrained = SamplingParams(max_tokens=args.tokens, temperature=0.8, seed=1,
                                 ignore_eos=True, structured_outputs=spec)
    mixed = [free if i % 2 else constrained for i in range(args.batch)]
    run(llm, prompts[:4], [free] * 4)  # warm-up, and the grammar compiled once (cached)
    run(llm, prompts[:4], [constrained] * 4)
    clock = _Clock()
    walls: dict[str, list[float]] = {"free": [], "mixed": []}
    for _ in range(args.rounds):
        walls["free"].append(run(llm, prompts, [free] * args.batch))
        walls["mixed"].append(run(llm, prompts, mixed))
    print(f"batch={args.batch} tokens={args.tokens} rounds={args.rounds} "
          f"model={llm.engine.model_name}")
    for name, label in (("free", "all free"), ("mixed", "half constrained")):
        best, mid = min(walls[name]), statistics.median(walls[name])
        print(f"{label:17s} best {best:6.2f} s ({args.tokens / best:5.1f} tok/s per request, "
              f"{args.batch * args.tokens / best:6.1f} total)  median {mid:6.2f} s")
    drop = 1 - min(walls["free"]) / min(walls["mixed"])
    hooks = clock.seconds / args.rounds  # per mixed run
    print(f"free requests' throughput drop, best rounds' wall times: {100 * drop:.1f}%")
    print(f"structured-output code (masks + matchers): {1000 * hooks / args.tokens:.2f} ms per "
          f"step, {100 * hooks / min(walls['free']):.1f}% of the best free run: the drop the "
          "constrained rows cause, measured without the machine's noise")


if __name__ == "__main__":
    main()
