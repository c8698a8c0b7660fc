"""Multi-LoRA in the engine (issue 24), against transformers + peft.

Adapters are made by ``peft`` (random, non-zero: ``init_lora_weights=False``). For tiny random
models of several families (Llama, Qwen2 with rsLoRA, Gemma 2, Phi-3's fused projections,
Mixtral's attention) and for the default model, the engine's greedy tokens equal transformers'
with the adapter merged (``merge_and_unload``), and their logprobs agree within 1e-4, whether
the step holds one adapter or adapters and the base model together. With ``max_loras=2`` a
step of the base model and three adapters gives each request what it gives alone, while the
third adapter waits (deferred, then admitted: never starved). Bad adapters are refused with a
400 naming the field or module, and the engine keeps serving. The prefix cache never shares
blocks across adapters or across weights loaded under one name. Tensor parallelism over two
ranks gives one rank's tokens. The step-path tests run with async scheduling off and on.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.lora import admission
from services.engine.lora.request import LoRAModule, LoRARequest
from services.protocol.wire import BadRequest
from tests.support.lora import (
    DENSE_TARGETS,
    PHI3_TARGETS,
    edit_config,
    greedy,
    reference,
    write_adapter,
)

LOGPROB_ATOL = 1e-4
NEW_TOKENS = 10
PHI3 = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": None, "hidden_size": 128}

# (id, architecture, config overrides, PEFT target modules, rsLoRA)
FAMILIES = [
    ("llama", "LlamaForCausalLM", {}, DENSE_TARGETS, False),
    ("qwen2-bias-rslora", "Qwen2ForCausalLM", {}, DENSE_TARGETS, True),
    ("gemma2", "Gemma2ForCausalLM",
     {"sliding_window": 6, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 1.5,
      "final_logit_softcapping": 3.0}, ("q_proj", "v_proj", "gate_proj", "down_proj"), False),
    ("phi3-fused", "Phi3ForCausalLM", PHI3, PHI3_TARGETS, False),
    ("mixtral-attention", "MixtralForCausalLM", {"num_local_experts": 4,
                                                 "num_experts_per_tok": 2},
     ("q_proj", "k_proj", "v_proj", "o_proj"), False),
]


def _ids(n: int, seed: int, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [_ids(21, 1), _ids(9, 2)]


def _engine(path: Path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), enable_lora=True, block_size=8,
                                  num_blocks=64, **kw))


def _run(engine: LLMEngine, jobs: Sequence[tuple[list[int], LoRARequest | str | None]],
         n: int = NEW_TOKENS, logprobs: bool = True) -> list[tuple[list[int], list[float]]]:
    """Greedy outputs (tokens, logprobs) of every (prompt, adapter) job, run together."""
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                            logprobs=0 if logprobs else None)
    reqs = [engine.add_request(f"r{i}", p, params, lora_request=lora)
            for i, (p, lora) in enumerate(jobs)]
    lps: dict[str, list[float]] = {r.request_id: [] for r in reqs}
    while engine.has_unfinished_requests():
        for u in engine.step():
            lps[u.request_id].extend(lp.logprob for lp in u.new_logprobs if lp is not None)
    return [(list(r.output_token_ids), lps[r.request_id]) for r in reqs]


def _assert_matches(got: tuple[list[int], list[float]], want: tuple[list[int], list[float]]
                    ) -> None:
    assert got[0] == want[0]
    assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) <= LOGPROB_ATOL


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def scheduling(request) -> dict[str, bool]:
    """The engine's ``async_scheduling``: LoRA steps give the same tokens either way."""
    return {"async_scheduling": request.param}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> Path:
    return tiny_model_dir("LlamaForCausalLM")


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("family", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_family_matches_peft_merge(family, tiny_model_dir, adapters: Path, scheduling) -> None:
    name, architecture, overrides, targets, rslora = family
    base = tiny_model_dir(architecture, **overrides)
    adapter = write_adapter(base, adapters / name, seed=11, targets=targets, rslora=rslora)
    merged, plain = reference(base, adapter), reference(base, None)
    want = [greedy(merged, p, NEW_TOKENS) for p in PROMPTS]
    engine = _engine(base, max_loras=2, max_lora_rank=8, **scheduling)
    lora = LoRARequest(name, 1, str(adapter))
    # One step holding the adapter and the base model (the grouped path) ...
    mixed = _run(engine, [(PROMPTS[0], lora), (PROMPTS[1], lora), (PROMPTS[0], None)])
    for got, ref in zip(mixed[:2], want, strict=True):
        _assert_matches(got, ref)
    _assert_matches(mixed[2], greedy(plain, PROMPTS[0], NEW_TOKENS))
    assert mixed[0][0] != mixed[2][0], "the adapter must change the output"
    # ... and steps of the adapter alone (every token one slot: the dense path).
    alone = _run(engine, [(PROMPTS[1], lora)])
    _assert_matches(alone[0], want[1])


def test_default_model_matches_peft_merge(default_model_path: Path, adapters: Path) -> None:
    adapter = write_adapter(default_model_path, adapters / "smollm2", seed=5, r=16, rslora=True)
    merged = reference(default_model_path, adapter)
    with LLM(str(default_model_path), enable_lora=True, max_lora_rank=16, num_blocks=64) as llm:
        prompts = ["The capital of France is", "def fibonacci(n):"]
        ids = [llm.get_tokenizer().encode(p) for p in prompts]
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
        outs = llm.generate(prompts, params, use_tqdm=False,
                            lora_request=LoRARequest("smol", 7, str(adapter)))
        base = llm.generate(prompts[:1], params, use_tqdm=False)
    for out, prompt in zip(outs, ids, strict=True):
        tokens, lps = greedy(merged, prompt, 8)
        got = out.outputs[0]
        assert got.token_ids == tokens
        chosen = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids, strict=True)]
        assert max(abs(a - b) for a, b in zip(chosen, lps, strict=True)) <= LOGPROB_ATOL
    assert base[0].outputs[0].token_ids != outs[0].outputs[0].token_ids


# --------------------------------------------------------------------------- scheduling


def test_three_adapters_over_two_slots_each_as_alone(llama: Path, adapters: Path,
                                                     scheduling) -> None:
    paths = [write_adapter(llama, adapters / f"mix{i}", seed=20 + i, r=4 + 2 * i)
             for i in range(3)]
    loras = [LoRARequest(f"mix{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    jobs = [(PROMPTS[0], None), (PROMPTS[1], loras[0]), (PROMPTS[0], loras[1]),
            (PROMPTS[1], loras[2]), (PROMPTS[0], loras[0])]
    engine = _engine(llama, max_loras=2, max_lora_rank=8, max_cpu_loras=3, **scheduling)
    alone = [_run(engine, [job])[0] for job in jobs]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    reqs = [engine.add_request(f"m{i}", p, params, lora_request=lora)
            for i, (p, lora) in enumerate(jobs)]
    deferred_before = engine.scheduler.num_deferrals
    first_step: dict[str, int] = {}
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        running = {r.adapter.key for r in engine.scheduler.running if r.adapter is not None}
        assert len(running) <= 2, running
        for r in engine.scheduler.running:
            first_step.setdefault(r.request_id, step)
    assert [list(r.output_token_ids) for r in reqs] == [a[0] for a in alone]
    assert engine.scheduler.num_deferrals > deferred_before
    # The third adapter's request waited for a slot, then ran.
    assert first_step["m3"] > first_step["m1"] and first_step["m3"] > first_step["m2"]


class _Adapter:
    def __init__(self, name: str) -> None:
        self.name = name
        self.key = name


def test_a_deferred_adapter_is_not_starved() -> None:
    """Two busy adapters keep arriving; the third one's request still gets in: after
    ``MAX_DEFERRED_STEPS`` it reserves, the running ones drain, and it is admitted."""
    from services.engine.block_manager import BlockManager
    from services.engine.request import Request
    from services.engine.scheduler import Scheduler
    from services.protocol.block_hash import BlockHasher

    sched = Scheduler(BlockManager(256, 4, True), 64, 256, 128, admission.adapter_limit(2))
    hasher = BlockHasher("m", 4)
    count = 0

    def add(name: str) -> Request:
        nonlocal count
        count += 1
        req = Request(f"{name}{count}", [1, 2, 3], SamplingParams(max_tokens=3), hasher, 3)
        req.adapter = _Adapter(name)
        sched.add(req)
        return req

    add("a"), add("b")
    starved = add("c")
    steps = 0
    while starved not in sched.running:
        assert steps < admission.MAX_DEFERRED_STEPS + 10, "the third adapter was starved"
        add("a"), add("b")  # the busy adapters never stop arriving
        out = sched.schedule()
        assert len({r.adapter.key for r in sched.running}) <= 2
        sched.update(out, [7] * sum(s.completes_sequence for s in out.scheduled))
        steps += 1
    assert steps >= admission.MAX_DEFERRED_STEPS  # it was deferred first


# --------------------------------------------------------------------------- refusals


def _refused(engine: LLMEngine, path: Path, param: str, *words: str) -> None:
    with pytest.raises(BadRequest) as err:
        engine.add_lora(LoRARequest("bad", 9, str(path)))
    assert err.value.param == param, (err.value.param, str(err.value))
    for word in words:
        assert word in str(err.value), str(err.value)


def test_unsupported_adapters_are_refused_and_serving_goes_on(
        llama: Path, tiny_model_dir, adapters: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    good = write_adapter(llama, adapters / "good", seed=3)
    engine = _engine(llama, max_lora_rank=16)
    _refused(engine, edit_config(good, tmp_path / "dora", use_dora=True), "use_dora", "DoRA")
    _refused(engine, edit_config(good, tmp_path / "save", modules_to_save=["lm_head"]),
             "modules_to_save")
    _refused(engine, edit_config(good, tmp_path / "emb", target_modules=["embed_tokens"]),
             "target_modules", "embed_tokens")
    _refused(engine, write_adapter(llama, adapters / "r32", seed=4, r=32, targets=["q_proj"]),
             "r", "32", "max-lora-rank")
    other = tiny_model_dir("LlamaForCausalLM", hidden_size=32, head_dim=8)
    _refused(engine, write_adapter(other, adapters / "other", seed=5), "lora_path",
             "model.layers.0.", "another model")
    corrupt = edit_config(good, tmp_path / "corrupt")
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    _refused(engine, corrupt, "lora_path", "corrupt")
    _refused(engine, tmp_path / "missing", "lora_path")
    experts = edit_config(good, tmp_path / "experts")
    tensors = load_file(experts / "adapter_model.safetensors")
    tensors = {k.replace("mlp.down_proj", "mlp.experts.0.down_proj"): v
               for k, v in tensors.items()}
    save_file(tensors, experts / "adapter_model.safetensors")
    _refused(engine, experts, "target_modules", "model.layers.0.mlp.experts.0.down_proj")
    assert engine.list_loras() == set()
    out = _run(engine, [(PROMPTS[0], LoRARequest("good", 1, str(good))), (PROMPTS[1], None)],
               n=4, logprobs=False)
    assert all(len(t) == 4 for t, _ in out)
    with pytest.raises(BadRequest) as err:
        engine.add_request("x", PROMPTS[0], SamplingParams(), lora_request="nope")
    assert err.value.param == "lora_name"


def test_lora_modules_load_at_start_and_flags_are_checked(llama: Path, adapters: Path) -> None:
    good = write_adapter(llama, adapters / "good", seed=3)
    engine = _engine(llama, lora_modules=(LoRAModule.parse(f"static={good}"),))
    assert engine.list_loras() == {"static"}
    assert _run(engine, [(PROMPTS[0], "static")], n=3, logprobs=False)[0][0]
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="enable_lora"):
        EngineConfig(lora_modules=(LoRAModule("a", "/x"),))
    assert LoRAModule.parse('{"name": "j", "path": "/p", "base_model_name": "m"}') == \
        LoRAModule("j", "/p", "m")
    with pytest.raises(ValueError):
        LoRARequest("x", 0, "/p")


# --------------------------------------------------------------------------- prefix cache


def test_prefix_cache_is_per_adapter_and_per_weights(llama: Path, adapters: Path,
                                                     scheduling) -> None:
    one, two = (write_adapter(llama, adapters / f"pc{i}", seed=30 + i) for i in range(2))
    engine = _engine(llama, max_loras=2, **scheduling)
    prompt = _ids(40, 9)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    def cached(lora) -> tuple[int, list[int]]:
        req = engine.add_request(f"c{engine.scheduler.num_preemptions}{id(lora)}{cached.n}",
                                 prompt, params, lora_request=lora)
        cached.n += 1
        while engine.has_unfinished_requests():
            engine.step()
        return req.num_cached_tokens, list(req.output_token_ids)

    cached.n = 0
    a = LoRARequest("pc", 1, str(one))
    assert cached(a)[0] == 0
    assert cached(a)[0] == 32  # 4 of 5 blocks: a hit never covers the whole prompt
    assert cached(LoRARequest("pc-two", 2, str(two)))[0] == 0  # another adapter: no hit
    assert cached(None)[0] == 0  # the base model: no hit
    # New weights under the old name: the old blocks are unreachable.
    hits, tokens = cached(LoRARequest("pc", 1, str(two)))
    assert hits == 0
    assert tokens == cached(LoRARequest("pc-two", 2, str(two)))[1]
    # Unloaded, the name is unknown; the same weights loaded again hash the same.
    assert engine.remove_lora("pc")
    with pytest.raises(BadRequest):
        engine.add_request("gone", prompt, params, lora_request="pc")


# --------------------------------------------------------------------------- tensor parallel


def test_two_ranks_give_one_ranks_tokens(tiny_model_dir, adapters: Path) -> None:
    base = tiny_model_dir("Qwen2ForCausalLM")
    adapter = write_adapter(base, adapters / "tp", seed=41, rslora=True)
    lora = LoRARequest("tp", 1, str(adapter))
    jobs = [(PROMPTS[0], lora), (PROMPTS[1], None), (PROMPTS[1], lora)]
    one = _run(_engine(base), jobs, logprobs=False)
    two = _engine(base, tensor_parallel_size=2)
    try:
        assert _run(two, jobs, logprobs=False) == one
    finally:
        two.close()


def test_lora_request_lists_in_generate(tiny_model_dir, default_model_path, adapters: Path,
                                        tmp_path: Path) -> None:
    """``generate`` takes one LoRARequest for all prompts or one per prompt (None: base)."""
    model = tmp_path / "with-tokenizer"
    shutil.copytree(tiny_model_dir("LlamaForCausalLM"), model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_path / name, model / name)
    adapter = write_adapter(model, adapters / "gen", seed=51)
    lora = LoRARequest("gen", 3, str(adapter))
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    with LLM(str(model), enable_lora=True, num_blocks=32, block_size=8) as llm:
        both = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=[lora, None])
        one = llm.generate(PROMPTS[:1], params, use_tqdm=False, lora_request=lora)
        base = llm.generate(PROMPTS[1:], params, use_tqdm=False)
        with pytest.raises(ValueError, match="2 prompts"):
            llm.generate(PROMPTS, params, use_tqdm=False, lora_request=[lora])
    assert both[0].outputs[0].token_ids == one[0].outputs[0].token_ids
    assert both[1].outputs[0].token_ids == base[0].outputs[0].token_ids
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 8


# --------------------------------------------------------------------------- runtime loads


def test_runtime_loads_stay_inside_the_adapter_roots(llama: Path, adapters: Path,
                                                     tmp_path: Path) -> None:
    """``../``, absolute paths elsewhere and symlinks (of the directory or of a file in it,
    whether they leave the roots or not) are a 400 naming lora_path."""
    from services.engine.lora import commands

    good = write_adapter(llama, adapters / "good", seed=3)
    root, outside = tmp_path / "root", tmp_path / "outside"
    shutil.copytree(good, root / "ok")
    shutil.copytree(good, outside / "secret")
    (root / "dir-link").symlink_to(outside / "secret")
    (root / "file-link").mkdir()
    (root / "file-link" / "adapter_config.json").symlink_to(
        outside / "secret" / "adapter_config.json")
    shutil.copy(good / "adapter_model.safetensors", root / "file-link")
    (root / "inner-link").symlink_to(root / "ok")  # stays inside, yet not followed either
    engine = _engine(llama, max_loras=2, max_cpu_loras=2)
    manager, roots = engine.lora, (str(root),)

    def load(name: str, path: str) -> commands.AdapterReply:
        return commands.run(manager, commands.AdapterCommand(commands.LOAD, name, path, roots))

    for path in ("../outside/secret", str(outside / "secret"), "ok/../../outside/secret",
                 "dir-link", "file-link", "inner-link", "dir-link/../ok", "missing"):
        reply = load("bad", path)
        assert (reply.status, reply.param) == (400, "lora_path"), (path, reply)
    assert load("ok", "ok").status == 200  # relative to the first root
    assert load("ok", "ok").status == 200  # the same again: nothing changes
    assert load("ok", str(root / "ok")).status == 409  # the name holds another path
    assert load("abs", str(root / "ok")).status == 200
    unload = commands.AdapterCommand(commands.UNLOAD, "nope")
    assert commands.run(manager, unload).status == 404
    no_roots = commands.run(manager, commands.AdapterCommand(commands.LOAD, "x", str(good)))
    assert (no_roots.status, no_roots.param) == (400, "lora_path")


def test_speculative_decoding_under_adapters_gives_the_same_tokens(llama: Path, adapters: Path,
                                                                   scheduling) -> None:
    """Prompt lookup (ngram) verifies several tokens per step; the adapter layout covers the
    verified rows too, so each request's greedy tokens are what they are without drafts."""
    from tests.support.spec_decode import ngram, repetitive_prompts

    paths = [write_adapter(llama, adapters / f"spec{i}", seed=40 + i) for i in range(2)]
    loras = [LoRARequest(f"spec{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    prompts = repetitive_prompts(4, 256, seed=3)
    jobs = [(prompts[0], loras[0]), (prompts[1], None), (prompts[2], loras[1]),
            (prompts[3], loras[0])]
    plain = _run(_engine(llama, max_loras=2, **scheduling), jobs, logprobs=False)
    drafted = _engine(llama, max_loras=2, speculative_config=ngram(), **scheduling)
    assert _run(drafted, jobs, logprobs=False) == plain
    assert drafted.stats().spec_decode.num_accepted_tokens > 0  # drafts accepted
