"""Tensor parallelism on the CPU (gloo): N ranks must compute what one rank does.

Logits of tiny random Llama / Qwen2 / Qwen3 models over 2 ranks equal one rank's within fp32
tolerance (GQA with fewer KV heads than ranks too); the default model (9 query, 3 KV heads) over
3 ranks generates exactly one rank's greedy tokens through chunked prefill, prefix caching and
preemption; seeded, top-k and greedy rows sampled on the vocabulary shards over 2 and 3 ranks
give one rank's tokens (and a step with a logprobs row gathers); a rank's loader reads only its
slices of the checkpoint; a dead worker ends the
engine process within seconds; sizes that cannot be split are refused before anything starts;
a user's script read from standard input, or without a ``__main__`` guard, starts its workers
(they never re-import it) and exits cleanly.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.model_runner import ModelRunner
from services.engine.models import loader
from services.engine.models.loader import load_model
from services.engine.parallel.group import TPGroup, building
from services.engine.parallel.step_broadcast import StepBatch, decode, encode
from services.protocol import engine_api
from tests.support import spec_decode as sd
from tests.support.services import REPO, ServiceProcess, internal_headers

ATOL = 1e-5

# (id, architecture, config overrides): 4 query heads over 2 KV heads unless said otherwise.
VARIANTS = [
    ("llama-gqa", "LlamaForCausalLM", {}),
    # One KV head for two ranks: replicated; a vocabulary that 2 does not divide (padding).
    ("llama-1kv-tied-odd-vocab", "LlamaForCausalLM",
     {"num_key_value_heads": 1, "tie_word_embeddings": True, "vocab_size": 255}),
    ("qwen2-bias", "Qwen2ForCausalLM", {"tie_word_embeddings": False}),
    ("qwen3-qk-norm", "Qwen3ForCausalLM", {"tie_word_embeddings": False}),
    # Sliding window + soft-caps over the sharded heads; experts replicated on every rank, the
    # dense layer and the attention sharded.
    ("gemma2-window-softcap", "Gemma2ForCausalLM",
     {"sliding_window": 6, "attn_logit_softcapping": 1.5, "final_logit_softcapping": 3.0}),
    ("qwen3-moe", "Qwen3MoeForCausalLM",
     {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
      "norm_topk_prob": True, "mlp_only_layers": [1]}),
]

# Step 1: a prompt and a prefill chunk; step 2: decode of the first, the next chunk of the
# second (reading its first chunk's KV from the cache), whose 3 rows from row 1 are also scored
# (prompt_logprobs: the LM head's collective runs once more); block ids out of order.
STEPS = [
    StepBatch.of(list(range(3, 22)) + [7, 9, 11], [[3, 1], [0, 5]], [19, 3], [19, 3], [0]),
    StepBatch.of([42] + [13, 17, 19, 23], [[3, 1], [0, 5]], [20, 7], [1, 4], [0, 1], [1, 3]),
]


def _logits(path: Path, ranks: int) -> list[torch.Tensor]:
    config = EngineConfig(model=str(path), num_blocks=8, tensor_parallel_size=ranks)
    runner = ModelRunner(config, str(path))
    try:
        out = []
        for step in STEPS:
            scored: list[torch.Tensor] = []
            out.append(runner.forward_logits(step, scored.append))
            assert len(scored) == len(step.scored) // 2
            out.extend(scored)
        return out
    finally:
        runner.close()


@pytest.mark.parametrize("variant", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_two_ranks_give_one_ranks_logits(tiny_model_dir, variant) -> None:
    _, architecture, overrides = variant
    path = tiny_model_dir(architecture, **overrides)
    one, two = _logits(path, 1), _logits(path, 2)
    for a, b in zip(one, two, strict=True):
        assert a.shape == b.shape == (a.shape[0], overrides.get("vocab_size", 256))
        assert torch.allclose(a, b, atol=ATOL, rtol=0), (a - b).abs().max()


def test_default_model_over_three_ranks_is_greedy_identical(default_model_path) -> None:
    """SmolLM2-135M: 9 query and 3 KV heads, so 3 ranks (2 does not divide them). A small KV
    pool (6 blocks of 8) forces preemption; a shared prefix gives prefix-cache hits; a 32-token
    budget chunks the prefills."""
    shared = "You are a helpful assistant. Answer briefly and clearly. "
    prompts = [shared + "The capital of France is", "def fib(n):", shared + "List three primes:",
               "Once upon a time", shared + "Kubernetes is"]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    runs = {}
    for ranks in (1, 3):
        with LLM(str(default_model_path), tensor_parallel_size=ranks, num_blocks=6,
                 block_size=8, max_num_batched_tokens=32, max_num_seqs=4) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            stats = llm.engine.stats()
        runs[ranks] = [o.outputs[0].token_ids for o in outs]
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats
        assert sum(o.num_cached_tokens for o in outs) > 0
    assert runs[3] == runs[1]


# Seeded Gumbel-max, top-k and greedy rows: sampled on the shards (``shard_sampling``).
SHARD_SAMPLED = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                 SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True),
                 SamplingParams(max_tokens=8, temperature=0.8, top_k=20, seed=8,
                                ignore_eos=True),
                 SamplingParams(max_tokens=8, temperature=1.5, seed=9, ignore_eos=True)]
# A row with logprobs needs the whole vocabulary: its steps gather the logits.
GATHERED = SamplingParams(max_tokens=8, temperature=1.0, seed=10, logprobs=2, ignore_eos=True)


def _sample(engine: LLMEngine, params: list[SamplingParams]) -> list[list[int]]:
    prompts = [[5, 6, 7, 8, 9][: 2 + i] for i in range(len(params))]
    return sd.run(engine, prompts, params)


# Small steps: the warm-up meets few row counts.
SMALL = {"num_blocks": 32, "max_num_batched_tokens": 32, "max_num_seqs": 8}


@pytest.fixture(scope="module")
def shard_sampled(tiny_model_dir) -> tuple[Path, list[list[int]]]:
    """A model that 2 and 3 ranks split (6 heads; a vocabulary of 256: 86/86/84 over 3), and
    one rank's tokens for ``SHARD_SAMPLED + [GATHERED]``."""
    path = tiny_model_dir("LlamaForCausalLM", num_attention_heads=6, num_key_value_heads=6,
                          hidden_size=96, head_dim=16, intermediate_size=192)
    one = sd.engine(path, **SMALL)
    try:
        return path, _sample(one, SHARD_SAMPLED + [GATHERED])
    finally:
        one.close()


@pytest.mark.parametrize("ranks", [2, 3])
def test_sampling_on_shards_gives_one_ranks_tokens(shard_sampled, ranks) -> None:
    """Over 2 ranks and over 3, seeded and greedy rows give one rank's tokens, sampled on the
    shards or gathered; a step with a logprobs row is gathered, and so gives them too."""
    path, expected = shard_sampled
    engine = sd.engine(path, tensor_parallel_size=ranks, **SMALL)
    try:
        runner = engine.runner
        sampled_on_shards = []
        real = runner._sample_shards
        runner._sample_shards = lambda *a: sampled_on_shards.append(1) or real(*a)
        assert _sample(engine, SHARD_SAMPLED) == expected[:-1]
        assert len(sampled_on_shards) == 8  # every step of that batch
        assert _sample(engine, SHARD_SAMPLED + [GATHERED]) == expected
        assert len(sampled_on_shards) == 8  # none: a row needs the whole vocabulary
        runner.sample_on_shards = False
        assert _sample(engine, SHARD_SAMPLED) == expected[:-1]
    finally:
        engine.close()


def test_a_rank_reads_only_its_slices(tiny_model_dir, monkeypatch) -> None:
    """Built for rank 1 of 2 (no process group needed to load): every sharded tensor is read
    through ``get_slice``, never whole, and holds exactly its rows or columns of the full one."""
    path = tiny_model_dir("Qwen2ForCausalLM", tie_word_embeddings=False)
    full = dict(load_model(path).named_parameters())
    whole: list[str] = []
    real_open = loader.safe_open

    class Spy:
        def __init__(self, *args, **kwargs) -> None:
            self.inner = real_open(*args, **kwargs)

        def __enter__(self):
            self.file = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_tensor(self, name):
            whole.append(name)
            return self.file.get_tensor(name)

        def get_slice(self, name):
            return self.file.get_slice(name)

    monkeypatch.setattr(loader, "safe_open", Spy)
    with building(TPGroup(rank=1, size=2)):
        shard = dict(load_model(path).named_parameters())
    assert whole and all("norm" in n or n.endswith(("o_proj.bias", "down_proj.bias"))
                         for n in whole), whole
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    q, kv = 2 * 32, 32  # rank 1 of 2: query heads 2-3 (of 4), KV head 1 (of 2); head_dim 32
    qkv = full[f"{attn}.qkv_proj.weight"]
    expect = torch.cat([qkv[q : 2 * q], qkv[2 * q + kv : 2 * q + 2 * kv], qkv[2 * q + 3 * kv :]])
    assert torch.equal(shard[f"{attn}.qkv_proj.weight"], expect)
    assert torch.equal(shard[f"{attn}.o_proj.weight"], full[f"{attn}.o_proj.weight"][:, q:])
    gate_up = full[f"{mlp}.gate_up_proj.weight"]
    assert torch.equal(shard[f"{mlp}.gate_up_proj.weight"],
                       torch.cat([gate_up[64:128], gate_up[192:]]))
    assert torch.equal(shard[f"{mlp}.down_proj.weight"], full[f"{mlp}.down_proj.weight"][:, 64:])
    assert torch.equal(shard["lm_head.weight"], full["lm_head.weight"][128:])


def test_each_rank_takes_its_share_of_the_cores(monkeypatch) -> None:
    from services.engine import cpu_threads

    previous = torch.get_num_threads()
    monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        assert cpu_threads.configure(None, ranks=2) == 4
        assert cpu_threads.configure(None, ranks=3) == 2
        assert cpu_threads.configure(None, ranks=16) == 1
        assert cpu_threads.configure(3, ranks=2) == 3  # an explicit count is per rank
        monkeypatch.setenv("OMP_NUM_THREADS", "6")
        assert cpu_threads.configure(None, ranks=2) == 3
    finally:
        torch.set_num_threads(previous)


def test_step_batch_round_trip() -> None:
    for step in STEPS:
        assert decode(encode(step)).same_as(step)
    empty_rows = StepBatch.of([5], [[2, 4, 6]], [33], [1], [])
    assert decode(encode(empty_rows)).same_as(empty_rows)
    # speculative decoding: request 1 verifies 3 drafts, its last 4 tokens get logits
    drafts = StepBatch.of([5, 6, 7, 8, 9, 1], [[2], [3, 4]], [9, 20], [2, 4], [0, 1])
    drafts.extra_logits = np.array([0, 3])
    back = decode(encode(drafts))
    assert back.same_as(drafts) and back.extra_logits.tolist() == [0, 3]
    assert back.logits_rows().tolist() == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    ("overrides", "ranks", "message"),
    [
        ({}, 3, "must divide the model's 4 attention heads"),
        ({"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96}, 2,
         "3 KV heads: one must divide the other"),
        ({"intermediate_size": 102}, 4, "intermediate_size 102"),
    ],
)
def test_sizes_that_do_not_split_are_refused_at_start(tiny_model_dir, overrides, ranks,
                                                      message) -> None:
    path = tiny_model_dir("LlamaForCausalLM", **overrides)
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelRunner(EngineConfig(model=str(path), num_blocks=8, tensor_parallel_size=ranks),
                    str(path))


def test_a_family_that_does_not_shard_is_refused_at_start(tiny_model_dir) -> None:
    path = tiny_model_dir("Phi3ForCausalLM", pad_token_id=0)
    with pytest.raises(ValueError, match="Phi3ForCausalLM runs on one rank only"):
        ModelRunner(EngineConfig(model=str(path), num_blocks=8, tensor_parallel_size=2),
                    str(path))


@pytest.mark.skipif(torch.cuda.device_count() > 8, reason="needs fewer than 9 visible GPUs")
def test_more_ranks_than_gpus_is_refused_at_start(tiny_model_dir) -> None:
    path = tiny_model_dir("LlamaForCausalLM")
    config = EngineConfig(model=str(path), device="cuda", num_blocks=8, tensor_parallel_size=4)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 needs 4 GPUs"):
        ModelRunner(config, str(path))
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(tensor_parallel_size=0)


# --------------------------------------------------------------------------- user scripts

# A user's script as it comes: no ``if __name__ == "__main__"`` guard, ``services`` found only
# through a ``sys.path`` tweak (and in another working directory), and for "file" no shutdown
# at all: the workers must neither re-import it nor outlive it, and the exit must be clean.
SCRIPT = """
import json, sys
sys.path.insert(0, {repo!r})
from services.engine import LLM, SamplingParams
params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
llm = LLM({model!r}, tensor_parallel_size=2, num_blocks=16)
tokens = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids
print(json.dumps({{"tokens": tokens, "workers": llm.engine.runner.workers.pids}}))
{end}
"""
ENDINGS = {"stdin": "llm.shutdown()", "file": ""}


@pytest.mark.parametrize("how", sorted(ENDINGS))
def test_a_script_without_main_guard_starts_its_workers(fast_model_dir, tmp_path, how) -> None:
    """``python - <<EOF`` (its main module has no file for a spawned worker to re-import)
    and ``python script.py``, both without a guard: the workers start from their own module."""
    script = SCRIPT.format(repo=str(REPO), model=str(fast_model_dir), end=ENDINGS[how])
    if how == "file":
        (tmp_path / "script.py").write_text(script)
        argv, stdin = [sys.executable, "script.py"], None
    else:
        argv, stdin = [sys.executable, "-"], script
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(argv, input=stdin, cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert len(result["tokens"]) == 4
    assert "Traceback" not in done.stderr and "exits (status" not in done.stderr, done.stderr
    assert not any(_alive(pid) for pid in result["workers"])


# --------------------------------------------------------------------------- the server


def _server(path: Path) -> ServiceProcess:
    return ServiceProcess(
        "services.engine.serving.server",
        ["--model", str(path), "--num-blocks", "16", "--tensor-parallel-size", "2"],
        env={"OMP_NUM_THREADS": "2"},
    )


def _worker_pid(proc: ServiceProcess) -> int:
    found = re.search(r"worker rank=1 pid=(\d+) started", proc.log_text())
    assert found, proc.log_tail()
    return int(found.group(1))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (killed, not yet reaped by its parent) is dead too.
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _generate(url: str) -> list[int]:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    body = engine_api.GenerateRequest("tp-1", [5, 6, 7, 8], params, None).to_msgpack()
    req = urllib.request.Request(url + engine_api.GENERATE_PATH, body, internal_headers())
    with urllib.request.urlopen(req, timeout=30) as r:
        frames = engine_api.FrameDecoder().feed(r.read())
    return [t for f in frames if isinstance(f, engine_api.TokensFrame) for t in f.token_ids]


def _exit_within(proc: ServiceProcess, seconds: float) -> tuple[int, float]:
    start = time.monotonic()
    code = proc.proc.wait(seconds)
    return code, time.monotonic() - start


def test_server_serves_and_stops_cleanly_over_two_ranks(tiny_model_dir) -> None:
    with _server(tiny_model_dir("LlamaForCausalLM")) as proc:
        worker = _worker_pid(proc)
        assert len(_generate(proc.url)) == 4
        proc.proc.send_signal(signal.SIGTERM)
        code, _ = _exit_within(proc, 20)
        assert code == 0, proc.log_tail()
        assert not _alive(worker)
        assert "exits (status" not in proc.log_text()


def test_workers_die_with_their_engine(tiny_model_dir) -> None:
    with _server(tiny_model_dir("LlamaForCausalLM")) as proc:
        worker = _worker_pid(proc)
        proc.kill()  # SIGKILL: no handler runs; the kernel ends the worker (PR_SET_PDEATHSIG)
        deadline = time.monotonic() + 5
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker)


def test_a_dead_worker_ends_the_engine_within_seconds(tiny_model_dir) -> None:
    with _server(tiny_model_dir("LlamaForCausalLM")) as proc:
        os.kill(_worker_pid(proc), signal.SIGKILL)
        code, took = _exit_within(proc, 10)
        print(f"\nengine exited {took:.2f}s after its worker was killed (status {code})")
        assert code != 0 and took < 5, proc.log_tail()
        assert "worker rank 1 (pid" in proc.log_text() and "exited with code -9" in proc.log_text()


def test_a_hung_worker_ends_the_engine_within_seconds(tiny_model_dir) -> None:
    """A stopped worker (SIGSTOP) never exits: its silent heartbeat link ends the engine as its
    death would, long before the step watchdog."""
    with _server(tiny_model_dir("LlamaForCausalLM")) as proc:
        worker = _worker_pid(proc)
        assert len(_generate(proc.url)) == 4  # serving: the worker pings
        os.kill(worker, signal.SIGSTOP)
        try:
            code, took = _exit_within(proc, 10)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
        print(f"\nengine exited {took:.2f}s after its worker was stopped (status {code})")
        assert code != 0 and took < 5, proc.log_tail()
        assert "worker rank 1 (pid" in proc.log_text() and "went silent" in proc.log_text()
