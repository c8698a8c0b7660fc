"""Async scheduling (step n+1 scheduled and prepared while step n runs) gives exactly what
synchronous stepping gives, frees every block, and really overlaps."""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import pytest

from services.engine.block_manager import BlockManager
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.llm import LLM
from services.engine.request import Request, RequestStatus
from services.engine.scheduler import Scheduler
from services.engine.serving.core_loop import Abort, Add, CoreLoop, CoreOutputs
from services.protocol.block_hash import BlockHasher
from services.protocol.sampling_params import SamplingParams
from services.protocol.structured_outputs import StructuredOutputsParams

# Small pools and budgets: chunked prefill (64 tokens a step), preemption (32 blocks of 16).
ENGINE = {"max_num_batched_tokens": 64, "max_num_seqs": 8, "num_blocks": 32, "block_size": 16}


@pytest.fixture(scope="module")
def engines(fast_model_dir: Path) -> dict[bool, LLM]:
    made = {on: LLM(str(fast_model_dir), async_scheduling=on, **ENGINE) for on in (False, True)}
    assert made[True].engine.pipeline is not None and made[False].engine.pipeline is None
    yield made
    for llm in made.values():
        llm.engine.close()


def _prompts(n: int) -> list[list[int]]:
    # Lengths 5..140, some sharing a 40-token prefix (prefix-cache hits inside the batch).
    shared = [(7 * j) % 900 + 50 for j in range(40)]
    out = []
    for i in range(n):
        body = [(31 * i + 11 * j) % 1000 + 30 for j in range(5 + (i * 37) % 100)]
        out.append(shared + body if i % 3 == 0 else body)
    return out


def _summary(outs) -> tuple[list, list[float]]:
    """Everything exact (tokens, texts, finish and stop reasons, cached tokens, logprob ranks)
    and, apart, the logprob values: a batch of another shape moves them by float rounding."""
    exact, values = [], []
    for o in outs:
        samples = []
        for c in o.outputs:
            ranked = None if c.logprobs is None else [
                sorted((t, lp.rank) for t, lp in d.items()) for d in c.logprobs]
            values += [lp.logprob for d in c.logprobs or [] for lp in d.values()]
            samples.append((c.token_ids, c.text, c.finish_reason, c.stop_reason, ranked))
        exact.append((o.num_cached_tokens, len(o.prompt_token_ids), samples))
    return exact, values


def _same(a: tuple[list, list[float]], b: tuple[list, list[float]]) -> None:
    assert a[0] == b[0]
    assert a[1] == pytest.approx(b[1], abs=1e-4)


def _params(reference: list[list[int]]) -> list[SamplingParams]:
    """Greedy and seeded requests, ending by length, by a stop token mid-output, by a stop
    string, with logprobs and n=2."""
    stop_tok = reference[1][3]  # request 1's fourth token ends it there
    out = []
    for i in range(len(reference)):
        kind = i % 5
        if kind == 0:
            out.append(SamplingParams(max_tokens=3 + i, temperature=0.0, ignore_eos=True))
        elif kind == 1:
            out.append(SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_tok],
                                      logprobs=2))
        elif kind == 2:
            out.append(SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=i,
                                      logprobs=1, ignore_eos=True))
        elif kind == 3:
            out.append(SamplingParams(max_tokens=16, temperature=1.0, seed=100 + i, n=2))
        else:
            out.append(SamplingParams(max_tokens=18, temperature=0.0, stop=["e"],
                                      ignore_eos=True))
    return out


def _no_leak(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_async_equals_sync_under_chunking_caching_and_preemption(engines) -> None:
    prompts = _prompts(15)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    # on both engines, so that their prefix caches start alike
    reference = [o.outputs[0].token_ids
                 for o in engines[False].generate(prompts, greedy, use_tqdm=False)]
    engines[True].generate(prompts, greedy, use_tqdm=False)
    params = _params(reference)
    results = {}
    for on, llm in engines.items():
        before = llm.engine.scheduler.num_preemptions
        first = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts, params, use_tqdm=False)  # prefix-cache hits
        assert llm.engine.scheduler.num_preemptions > before  # the pool is too small for all
        assert sum(o.num_cached_tokens for o in again) > 0
        _no_leak(llm)
        results[on] = (_summary(first), _summary(again))
    for run in range(2):
        _same(results[True][run], results[False][run])
    sync_first = results[False][0][0]
    reasons = {c[2] for *_, samples in sync_first for c in samples}
    assert reasons == {"length", "stop"}  # both ends occur, mid-batch
    assert sync_first[1][2][0][3] is not None  # a stop token ended request 1
    assert sync_first[4][2][0][3] == "e"  # and a stop string request 4


def test_async_equals_sync_for_requests_that_need_host_tokens(engines) -> None:
    """Structured outputs, penalties, min_tokens, prompt logprobs: those steps run in turn."""
    prompts = _prompts(6)
    params = [
        SamplingParams(max_tokens=40, temperature=0.0,
                       structured_outputs=StructuredOutputsParams(regex=r"[a-z]{2,5}-[0-9]{1,3}")),
        SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3,
                       frequency_penalty=0.5, presence_penalty=0.2, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, min_tokens=6,
                       stop_token_ids=[_prompts(1)[0][0]]),
        SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.8, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
    ]
    pipeline = engines[True].engine.pipeline
    real_launch, launched = pipeline.launch, []

    def launch(sched, step, after=None):
        # A step starts while a token of such a request is still on its way: never.
        for s in sched.scheduled:  # (min_tokens only matters early: not checked here)
            if any(s.request.params is params[i] for i in (0, 1, 3)):
                assert s.request.num_placeholders <= 1, s.request.params
        launched.append(after is not None)
        real_launch(sched, step, after)

    pipeline.launch = launch
    results = {}
    for on, llm in engines.items():
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            if on:
                del pipeline.launch
        assert outs[0].outputs[0].finish_reason == "stop"
        prompt_lps = [[None if d is None else sorted((t, lp.rank) for t, lp in d.items())
                       for d in o.prompt_logprobs or []] for o in outs]
        results[on] = (_summary(outs), prompt_lps)
        _no_leak(llm)
    _same(results[True][0], results[False][0])
    assert results[True][1] == results[False][1]
    assert any(launched) and not all(launched)  # some steps overlapped, some ran in turn
    assert len(results[True][1][3]) == len(prompts[3])


def test_aborts_between_steps_free_everything(fast_model_dir: Path, engines) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = _prompts(6)
    runs = {}
    for on, llm in engines.items():
        engine = llm.engine
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        tokens: dict[str, list[int]] = {}
        aborted = None
        steps = 0
        while engine.has_unfinished_requests():
            for u in engine.step():
                tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
            steps += 1
            if steps == 4:  # r2 has tokens and, with async, a step in flight
                aborted = engine.abort_request("r2")
                assert aborted.finish_reason == "abort"
            if steps == 5:
                assert engine.abort_request("r2") is None  # gone for good
        # the abort's count is what the client got: no token of the step in flight
        assert aborted.num_output_tokens == len(tokens["r2"]) > 0
        runs[on] = tokens
        _no_leak(llm)
    assert runs[True] == runs[False]


def test_the_next_step_is_scheduled_and_prepared_while_a_step_runs(engines) -> None:
    """Ordering, not timing: each step's model run waits until the engine has scheduled and
    prepared the next step (or found none to schedule), which only happens if that host work
    overlaps the run; and step n's output is applied only after step n+1 has started."""
    engine: LLMEngine = engines[True].engine
    events: list[tuple[str, int]] = []
    cond = threading.Condition()
    schedules: list[bool] = []  # per schedule() call: did it schedule anything
    count = {"prepare": 0, "run": 0, "launch": 0, "update": 0}
    real = (engine.scheduler.schedule, engine.runner.prepare, engine.runner.run,
            engine.scheduler.update, engine.pipeline.launch)

    def note(kind: str) -> None:
        with cond:
            count[kind] += 1
            events.append((kind, count[kind]))
            cond.notify_all()

    def schedule():
        out = real[0]()
        with cond:
            schedules.append(not out.is_empty)
            cond.notify_all()
        return out

    def prepare(*args, **kw):
        step = real[1](*args, **kw)
        note("prepare")
        return step

    def ready(n: int) -> bool:  # step n+1 prepared, or nothing left to schedule after n
        return count["prepare"] > n or (len(schedules) > n and not schedules[n])

    def run(*args, **kw):
        note("run")
        n = count["run"]
        with cond:  # never true while step n runs if the engine stepped in turn
            overlapped = cond.wait_for(lambda: ready(n), timeout=20)
        assert overlapped, f"step {n + 1} was not prepared while step {n} ran"
        return real[2](*args, **kw)

    def update(sched, tokens, *runs):
        note("update")
        return real[3](sched, tokens, *runs)

    def launch(*args, **kw):
        real[4](*args, **kw)
        note("launch")

    engine.scheduler.schedule, engine.runner.prepare = schedule, prepare
    engine.runner.run, engine.scheduler.update = run, update
    engine.pipeline.launch = launch
    try:
        for i, p in enumerate(_prompts(4)):
            engine.add_request(f"o{i}", p, SamplingParams(max_tokens=6, temperature=0.0,
                                                          ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        del engine.scheduler.schedule, engine.runner.prepare
        del engine.runner.run, engine.scheduler.update, engine.pipeline.launch
    runs = count["run"]
    assert runs >= 6 and count["update"] == count["launch"] == runs
    order = {e: i for i, e in enumerate(events)}
    for n in range(1, runs):
        assert order[("prepare", n + 1)] < order[("update", n)]  # scheduled before applied
        assert order[("launch", n + 1)] < order[("update", n)]  # applied while n+1 runs
    _no_leak(engines[True])


# -- the scheduler's bookkeeping, without a model -------------------------------------------

BS = 4


def _request(rid: str, n: int, max_tokens: int) -> Request:
    return Request(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=max_tokens),
                   BlockHasher("m", BS), max_tokens, eos_token_ids=(2,))


def test_a_request_finished_by_the_step_in_flight_gets_no_extra_token() -> None:
    sched = Scheduler(BlockManager(16, BS), 4, 64, 1024)
    a, b = _request("a", 6, max_tokens=8), _request("b", 5, max_tokens=8)
    sched.add(a)
    sched.add(b)
    n1 = sched.schedule()
    n2 = sched.schedule()  # while n1 runs: one placeholder each
    assert [(s.start, s.num_new_tokens, s.completes_sequence) for s in n2.scheduled] == [
        (6, 1, True), (5, 1, True)]
    assert sched.update(n1, [2, 9]) == [a, b]  # a samples EOS: finished, blocks freed
    assert a.status is RequestStatus.FINISHED_STOPPED and a.output_token_ids == [2]
    n3 = sched.schedule()  # n2 in flight; a is gone
    assert [s.request for s in n3.scheduled] == [b]
    assert sched.update(n2, [7, 8]) == [b]  # a's extra token is dropped
    assert a.output_token_ids == [2] and b.output_token_ids == [9, 8]
    assert sched.update(n3, [4]) == [b]
    assert b.output_token_ids == [9, 8, 4] and b.num_computed_tokens == 7
    assert b.num_scheduled_tokens == 0 and b.num_placeholders == 0
    sched.abort(b)
    assert sched.block_manager.num_free_blocks == 16


def test_no_step_is_scheduled_for_a_request_whose_last_token_is_in_flight() -> None:
    sched = Scheduler(BlockManager(16, BS), 4, 64, 1024)
    a = _request("a", 6, max_tokens=1)
    sched.add(a)
    n1 = sched.schedule()
    assert sched.schedule().is_empty  # its one token is on its way: it surely finishes
    assert sched.update(n1, [9]) == [a] and a.status is RequestStatus.FINISHED_LENGTH
    assert not sched.has_unfinished() and sched.block_manager.num_free_blocks == 16


def test_a_request_preempted_with_a_token_in_flight_keeps_it() -> None:
    # 4 blocks of 4: a (8 tokens) and b (7) fill them; a's next decode preempts b while b's
    # first token is still in flight.
    sched = Scheduler(BlockManager(4, BS), 4, 64, 1024)
    a, b = _request("a", 8, max_tokens=4), _request("b", 7, max_tokens=4)
    sched.add(a)
    sched.add(b)
    n1 = sched.schedule()
    n2 = sched.schedule()
    assert n2.preempted == [b] and [s.request for s in n2.scheduled] == [a]
    assert sched.update(n1, [5, 6]) == [a, b]
    assert b.status is RequestStatus.PREEMPTED and b.output_token_ids == [6]
    assert b.num_computed_tokens == 0 and b.num_placeholders == 0 and sched.waiting[0] is b
    sched.update(n2, [7])
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, [5] * sum(s.completes_sequence for s in out.scheduled))
    assert a.num_output_tokens == b.num_output_tokens == 4
    assert sched.block_manager.num_free_blocks == 4


# -- the server's step loop -----------------------------------------------------------------


def _serve(model: Path, on: bool) -> tuple[dict, dict, int]:
    """Runs the core loop on its own thread (as the server does) with five requests; aborts r0
    once it has streamed three tokens. Returns each request's streamed tokens, its finish
    (reason, output tokens counted), and the blocks still held once the loop stopped."""
    outputs: queue.Queue[CoreOutputs] = queue.Queue()
    loop = CoreLoop(EngineConfig(model=str(model), async_scheduling=on, **ENGINE), outputs.put,
                    step_delay_s=0.005)  # slow enough for the abort to land mid-request
    engine = loop.load()
    thread = threading.Thread(target=loop.run)
    thread.start()
    try:
        for i, prompt in enumerate(_prompts(5)):
            loop.commands.put(Add(f"r{i}", prompt, SamplingParams(
                max_tokens=200 if i == 0 else 10 + i, temperature=0.0, ignore_eos=True), None))
        tokens: dict[str, list[int]] = {}
        finished: dict[str, tuple[str, int]] = {}
        while len(finished) < 5:
            for u in outputs.get(timeout=60).updates:
                assert u.request_id not in finished  # nothing after the last update
                tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
                if u.finished:
                    finished[u.request_id] = (u.finish_reason, u.num_output_tokens)
                elif u.request_id == "r0" and len(tokens["r0"]) == 3:
                    loop.commands.put(Abort("r0"))
    finally:
        loop.stop()
        thread.join(timeout=30)
    bm = engine.block_manager
    return tokens, finished, bm.num_total_blocks - bm.num_free_blocks


def test_the_core_loop_streams_the_same_tokens_and_aborts_cleanly(fast_model_dir) -> None:
    runs = {on: _serve(fast_model_dir, on) for on in (False, True)}
    for tokens, finished, held in runs.values():
        assert held == 0
        reason, count = finished["r0"]
        assert reason == "abort" and count == len(tokens["r0"]) < 200
        assert all(finished[f"r{i}"] == ("length", 10 + i) for i in range(1, 5))
    (sync_tokens, _, _), (async_tokens, _, _) = runs[False], runs[True]
    for i in range(1, 5):
        assert async_tokens[f"r{i}"] == sync_tokens[f"r{i}"]
    short = min(len(sync_tokens["r0"]), len(async_tokens["r0"]))  # the abort lands anywhere
    assert async_tokens["r0"][:short] == sync_tokens["r0"][:short]


def test_the_server_flag() -> None:
    from services.engine.serving.server_config import configs_from_args

    assert configs_from_args([])[0].async_scheduling is None  # the device decides
    assert configs_from_args(["--async-scheduling"])[0].async_scheduling is True
    assert configs_from_args(["--async-scheduling=false"])[0].async_scheduling is False


def test_the_runner_is_built_on_the_step_thread(fast_model_dir, monkeypatch) -> None:
    """One thread does the model's math from load to the last step (a second OpenMP team in
    the process slows every CPU step: see StepPipeline)."""
    import services.engine.engine as engine_module
    from services.engine.model_runner import ModelRunner

    built_on, ran_on = [], []

    class Recording(ModelRunner):
        def __init__(self, *args, **kw) -> None:
            built_on.append(threading.current_thread())
            super().__init__(*args, **kw)

        def run(self, *args, **kw):
            ran_on.append(threading.current_thread())
            return super().run(*args, **kw)

    monkeypatch.setattr(engine_module, "ModelRunner", Recording)
    engine = LLMEngine(EngineConfig(model=str(fast_model_dir), async_scheduling=True, **ENGINE))
    try:
        engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.close()
    assert built_on[0] is not threading.main_thread()
    assert ran_on and set(ran_on) == {built_on[0]}
