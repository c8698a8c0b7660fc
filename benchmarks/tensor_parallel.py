"""Tensor parallelism's overhead on the CPU: the per-step broadcast, and TP=N against TP=1.

    .venv/bin/python benchmarks/tensor_parallel.py                 # ~1-2 minutes on 2 cores
    .venv/bin/python benchmarks/tensor_parallel.py --ranks 2 --steps 500 --requests 8

1. The step broadcast alone (``parallel.step_broadcast``): rank 0 sends ``--steps`` batches of
   each shape to ``--ranks - 1`` workers over gloo, which decode them; the time per step is
   the wall time over all steps (every rank has received the last one: a barrier ends it),
   with the payload size and the host cost of encoding + decoding it.
2. The default model (SmolLM2-135M, fp32) generating ``--requests`` greedy requests at TP=1
   and TP=N, ``--max-tokens`` each: output tokens/s and the mean time of a decode step.

3. ``--sampling``: sampling on the vocabulary shards against gathering the logits, in one
   engine at TP=2 and at TP=3 (SmolLM2-sized, vocabulary 49,152), alternating: the bytes rank 0
   receives from the other ranks' logits or candidates per step (every step samples each
   request), and the decode step's mean time, for seeded Gumbel-max rows and top-k 50 rows.

On a 2-core machine TP=N is slower than TP=1: every layer adds two all-reduces (o_proj and
down_proj) across processes that share the same cores, and this model is small. TP is for
models that do not fit one GPU; the overhead figure is the point here.
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist

from services.engine import LLM, SamplingParams
from services.engine.models.default import default_model_path
from services.engine.parallel import group as tp_group
from services.engine.parallel.step_broadcast import (
    StepBatch,
    decode,
    encode,
    receive_step,
    send_step,
    send_stop,
)


def shapes() -> dict[str, StepBatch]:
    """Typical steps: decode of 1, 32 and 128 requests (2k-token contexts, 16-token blocks),
    and a 512-token prefill chunk with 8 decodes."""

    def decode_step(n: int) -> StepBatch:
        tables = [list(range(i * 128, i * 128 + 128)) for i in range(n)]
        return StepBatch.of([7] * n, tables, [2040] * n, [1] * n, list(range(n)))

    mixed = decode_step(8)
    mixed.input_ids += [11] * 512
    mixed.block_tables.append(list(range(5000, 5032)))
    mixed.seq_lens.append(512)
    mixed.query_lens.append(512)
    mixed.rows.append(8)
    return {"decode x1": decode_step(1), "decode x32": decode_step(32),
            "decode x128": decode_step(128), "prefill 512 + decode x8": mixed}


def _worker(rank: int, size: int, port: int, kinds: int, steps: int) -> None:
    tp = tp_group.join(rank, size, tp_group.connect_store(port, size), _cpu())
    for _ in range(kinds):
        while receive_step(tp) is not None:
            pass
        dist.barrier(group=tp.step_group)
    _all_reduces(tp, steps)
    tp_group.leave()


def _all_reduces(tp: tp_group.TPGroup, steps: int) -> float:
    """Seconds per all-reduce of a decode step's activations (8 rows of hidden 576, fp32):
    what each o_proj and down_proj adds per layer."""
    import torch

    x = torch.ones(8, 576)
    start = time.perf_counter()
    for _ in range(steps):
        tp.all_reduce(x)
    dist.barrier(group=tp.step_group)
    return (time.perf_counter() - start) / steps


def _cpu():
    import torch

    return torch.device("cpu")


def bench_broadcast(ranks: int, steps: int) -> None:
    batches = shapes()
    store = tp_group.create_store(ranks)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, ranks, store.port, len(batches), steps))
             for r in range(1, ranks)]
    for p in procs:
        p.start()
    tp = tp_group.join(0, ranks, store, _cpu())
    print(f"step broadcast, rank 0 -> {ranks - 1} worker(s), gloo over loopback, "
          f"{steps} steps each:")
    print(f"  {'step':<26}{'payload':>10}{'encode+decode':>16}{'per step':>12}")
    for name, batch in batches.items():
        start = time.perf_counter()
        for _ in range(steps):
            decode(encode(batch))
        host_us = (time.perf_counter() - start) / steps * 1e6
        start = time.perf_counter()
        for _ in range(steps):
            send_step(tp, batch)
        send_stop(tp)
        dist.barrier(group=tp.step_group)
        per_step_us = (time.perf_counter() - start) / steps * 1e6
        size_kb = encode(batch).nbytes / 1024
        print(f"  {name:<26}{size_kb:>8.1f}KB{host_us:>13.0f} us{per_step_us:>9.0f} us")
    print(f"  model all-reduce [8 x 576] fp32: {_all_reduces(tp, steps) * 1e6:.0f} us each "
          "(two per layer per step)")
    for p in procs:
        p.join()
    tp_group.leave()


def model_for(ranks: int, tmp: Path) -> tuple[str, str]:
    """The default model when ``ranks`` divides its 9 heads, else a random Llama of its size
    (30 layers, hidden 576, vocabulary 49152) with 8 query and 2 KV heads: (path, label)."""
    path = default_model_path()
    if 9 % ranks == 0:
        return str(path), "SmolLM2-135M"
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 8, 2, 72
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp)
    for file in path.iterdir():  # the tokenizer (prompts are text)
        if file.is_file() and not (tmp / file.name).exists():
            shutil.copy(file, tmp / file.name)
    return str(tmp), "random SmolLM2-sized Llama, 8 query / 2 KV heads"


def bench_generate(ranks: int, requests: int, max_tokens: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path, label = model_for(ranks, Path(tmp))
        _bench_generate(path, label, ranks, requests, max_tokens)


def _bench_generate(path: str, label: str, ranks: int, requests: int, max_tokens: int) -> None:
    prompts = [f"Question {i}: what is the capital of country number {i}? Answer:"
               for i in range(requests)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    print(f"\n{label}, fp32, {requests} greedy requests x {max_tokens} tokens:")
    results = {}
    for n in (1, ranks):
        llm = LLM(path, tensor_parallel_size=n, num_blocks=256)
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm
        step_times: list[float] = []
        runner = llm.engine.runner
        forward = runner.forward_logits

        def timed(batch, forward=forward, step_times=step_times):
            start = time.perf_counter()
            out = forward(batch)
            if len(batch.input_ids) == len(batch.seq_lens):  # a decode step
                step_times.append(time.perf_counter() - start)
            return out

        runner.forward_logits = timed
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        llm.engine.close()
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        results[n] = [o.outputs[0].token_ids for o in outs]
        step_ms = 1000 * sum(step_times) / max(1, len(step_times))
        print(f"  TP={n}: {tokens / wall:7.1f} output tok/s, decode step {step_ms:6.1f} ms")
    same = "identical" if results[1] == results[ranks] else "DIFFERENT"
    print(f"  greedy outputs TP=1 vs TP={ranks}: {same}")


def bench_sampling(requests: int, max_tokens: int, rounds: int) -> None:
    """Gathered logits against sampling on the shards, same engine, alternating rounds."""
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in (2, 3):
            path, label = model_for(ranks, Path(tmp) / str(ranks))
            _bench_sampling(path, label, ranks, requests, max_tokens, rounds)


def _bench_sampling(path: str, label: str, ranks: int, requests: int, max_tokens: int,
                    rounds: int) -> None:
    import torch

    prompts = [f"Question {i}: what is the capital of country number {i}? Answer:"
               for i in range(requests)]
    kinds = {
        "seeded Gumbel-max": [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i,
                                             ignore_eos=True) for i in range(requests)],
        "top-k 50, seeded": [SamplingParams(max_tokens=max_tokens, temperature=0.8, top_k=50,
                                            seed=i, ignore_eos=True) for i in range(requests)],
    }
    llm = LLM(path, tensor_parallel_size=ranks, num_blocks=256, max_num_seqs=requests)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm
    runner = llm.engine.runner
    received = [0]
    real_gather = dist.gather

    def counting_gather(tensor, gather_list=None, *args, **kwargs):
        if gather_list is not None:  # rank 0: what the other ranks send it
            received[0] += tensor.nbytes * (len(gather_list) - 1)
        return real_gather(tensor, gather_list, *args, **kwargs)

    torch.distributed.gather = counting_gather
    step_times: list[float] = []
    all_steps = [0]
    forward = runner.forward_logits

    def timed(batch, *args, **kwargs):
        start = time.perf_counter()
        out = forward(batch, *args, **kwargs)
        all_steps[0] += 1
        if len(batch.input_ids) == len(batch.seq_lens):  # a decode step
            step_times.append(time.perf_counter() - start)
        return out

    runner.forward_logits = timed
    print(f"\n{label}, fp32, TP={ranks}, {requests} requests x {max_tokens} tokens, "
          f"{rounds} alternating rounds (bytes: received by rank 0 per step)")
    for kind, params in kinds.items():
        figures = {False: [0.0, 0, 0, None, 0], True: [0.0, 0, 0, None, 0]}
        for _ in range(rounds):
            for on_shards in (False, True):
                runner.sample_on_shards = on_shards
                step_times.clear()
                received[0] = all_steps[0] = 0
                outs = llm.generate(prompts, params, use_tqdm=False)
                tokens = [o.outputs[0].token_ids for o in outs]
                f = figures[on_shards]
                f[0] += sum(step_times)
                f[1] += len(step_times)
                f[2] += received[0]
                f[4] += all_steps[0]
                assert f[3] in (None, tokens), "the same seeds gave other tokens"
                f[3] = tokens
        same = "identical" if figures[False][3] == figures[True][3] else "DIFFERENT"
        for on_shards, name in ((False, "gathered"), (True, "on shards")):
            total, steps, nbytes, _, every = figures[on_shards]
            print(f"  {kind:<18} {name:<10} {nbytes / max(1, every) / 1024:9.1f} KiB/step "
                  f"{1000 * total / max(1, steps):8.2f} ms/decode step")
        print(f"  {kind:<18} tokens gathered vs on shards: {same}")
    torch.distributed.gather = real_gather
    llm.engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--sampling", action="store_true",
                        help="only: sampling on the shards against the gather, TP=2 and 3")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.sampling:
        bench_sampling(args.requests, args.max_tokens, args.rounds)
        return
    bench_broadcast(args.ranks, args.steps)
    bench_generate(args.ranks, args.requests, args.max_tokens)


if __name__ == "__main__":
    main()
