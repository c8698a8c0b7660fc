"""Ranks in separate pods (a node group, as a LeaderWorkerSet starts them): a leader and a worker
node started as separate processes on loopback from the LWS environment alone, the two pods
holding two tensor-parallel shards or two pipeline stages (the worker stage 0, the leader the
last), or two stages of two tensor-parallel ranks each (each pod's process starting its local
worker).

The group serves through the router and the gateway the tokens a single-process engine
gives; a worker with another dtype is refused with the difference named; a worker SIGKILLed or
SIGSTOPped, or a worker pod's local rank SIGKILLed, takes the leader out of routing within 5 s
(its stream in flight ends with an error frame, the leader exits non-zero), and a restarted
group serves again.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from services.engine import LLM, SamplingParams
from services.engine.parallel.node_group import from_lws_env
from services.engine.serving.server_config import configs_from_args
from services.protocol import engine_api
from tests.faults.helpers import router_engines, wait_for
from tests.support.redis_server import free_port
from tests.support.services import ServiceProcess, internal_headers
from tests.support.stack import PagodaStack

PROMPT = "The capital of France is"
T1, T2 = "token-one-0123456789", "token-two-0123456789"  # tokens of 16+ characters
MAX_TOKENS = 8


def _lws(index: int) -> dict[str, str]:
    return {"LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": "2",
            "LWS_WORKER_INDEX": str(index), "OMP_NUM_THREADS": "1"}


# How the group's two pods split the model: two tensor-parallel shards, two pipeline stages (the
# leader runs the last: it samples), or two stages of two tensor-parallel ranks (a pod each).
LAYOUTS = {"tp": ["--tensor-parallel-size", "2"], "pp": ["--pipeline-parallel-size", "2"],
           "pp_tp": ["--pipeline-parallel-size", "2", "--tensor-parallel-size", "2"]}


def _group_args(port: int, layout: str = "tp") -> list[str]:
    return [*LAYOUTS[layout], "--master-port", str(port), "--dtype", "float32"]


def _session_token() -> str:
    return os.environ["PAGODA_INTERNAL_TOKENS"].split(",")[0]  # tests/conftest.py sets it


def _worker(model: Path, port: int, *extra: str, token: str | None = None,
            layout: str = "tp") -> ServiceProcess:
    env = {**_lws(1), "PAGODA_INTERNAL_TOKENS": token or _session_token()}
    return ServiceProcess("services.engine.serving.server",
                          ["--model", str(model), "--num-blocks", "64",
                           *_group_args(port, layout), *extra], env=env)


@contextlib.contextmanager
def _launched(proc: ServiceProcess):
    """``proc`` started without waiting for its health (a worker joins a leader that starts
    after it), stopped at the end."""
    proc.launch()
    try:
        yield proc
    finally:
        proc.stop()


def _stack(model: Path, port: int, layout: str = "tp") -> PagodaStack:
    return PagodaStack(model, engines=1, num_blocks=64, engine_args=[_group_args(port, layout)],
                       env=_lws(0))


def _complete(base_url: str, model: str) -> str:
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(base_url + "/completions", body,
                                 {"Content-Type": "application/json",
                                  "Authorization": "Bearer x"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["text"]


def _reference(model: Path) -> str:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    with LLM(str(model), num_blocks=64, dtype="float32") as llm:
        return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text


def test_lws_environment_sets_the_node_group() -> None:
    engine, _ = configs_from_args(_group_args(4000), env=_lws(1))
    assert (engine.nnodes, engine.node_rank, engine.master_addr) == (2, 1, "127.0.0.1")
    engine, _ = configs_from_args([], env={})
    assert (engine.nnodes, engine.node_rank) == (1, 0)
    with pytest.raises(ValueError, match="LWS_WORKER_INDEX must be a non-negative integer"):
        from_lws_env({**_lws(0), "LWS_WORKER_INDEX": "x"})
    with pytest.raises(SystemExit) as exit_info:  # LWS_GROUP_SIZE=2 without TP=2
        configs_from_args([], env=_lws(0))
    assert exit_info.value.code == 2
    engine, _ = configs_from_args(_group_args(4000, "pp"), env=_lws(1))
    assert (engine.nnodes, engine.pipeline_parallel_size, engine.world_size) == (2, 2, 2)
    engine, _ = configs_from_args(_group_args(4000, "pp_tp"), env=_lws(1))  # a stage per pod
    assert (engine.world_size, engine.ranks_per_node) == (4, 2)


@pytest.mark.parametrize("sizes", [["--tensor-parallel-size", "4"],  # a stage over 2 pods
                                   ["--pipeline-parallel-size", "4"],  # 2 stages in a pod
                                   ["--pipeline-parallel-size", "3"]])
def test_ranks_that_do_not_fit_the_pods_exit_2_naming_the_flags(sizes, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        configs_from_args([*sizes, "--master-port", "4000"], env=_lws(0))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--pipeline-parallel-size" in err and "--nnodes 2" in err, err


def test_a_worker_with_another_dtype_is_refused(fast_model_dir) -> None:
    port = free_port()
    leader = ServiceProcess("services.engine.serving.server",
                            ["--model", str(fast_model_dir), "--num-blocks", "64",
                             *_group_args(port)], env={**_lws(0), "PAGODA_INTERNAL_TOKENS": T1})
    with _launched(leader):
        wrong = _worker(fast_model_dir, port, "--dtype", "bfloat16", token=T1).launch()
        code = wrong.proc.wait(120)
        why = "dtype (leader 'float32', worker 'bfloat16')"
        assert code != 0 and why in wrong.log_text(), wrong.log_tail()
        stranger = _worker(fast_model_dir, port, token=T2).launch()
        assert stranger.proc.wait(60) != 0
        assert "internal credential was missing or not accepted" in stranger.log_text()
        assert why in leader.log_text() and "credential" in leader.log_text()
        # the leader still waits for a right worker, which then joins
        with _launched(_worker(fast_model_dir, port, token=T1)) as right:
            right.wait_healthy()
            leader.wait_healthy()
        wrong.stop()
        stranger.stop()


def _stream_until_error(url: str) -> list[object]:
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    body = engine_api.GenerateRequest("long-1", [5, 6, 7, 8], params, None).to_msgpack()
    frames: list[object] = []
    try:
        req = urllib.request.Request(url + engine_api.GENERATE_PATH, body, internal_headers())
        with urllib.request.urlopen(req, timeout=30) as r:
            decoder = engine_api.FrameDecoder()
            while chunk := r.read1(65536):
                frames += decoder.feed(chunk)
    except (urllib.error.URLError, ConnectionError, OSError):
        pass
    return frames


def _lose_worker(stack: PagodaStack, worker: ServiceProcess, sig: signal.Signals,
                 pid: int | None = None) -> None:
    """Sends ``sig`` to the worker node (or to ``pid``, one of its local ranks) while a stream
    decodes on the leader: the leader must leave routing within 5 s, end the stream with an
    error frame and exit non-zero; the worker must not outlive its group."""
    leader, router = stack.engines[0], stack.routers[0].url
    wait_for(lambda: router_engines(router) == {stack.engine_id(0)}, 10, "router sees it")
    frames: list[object] = []
    streaming = threading.Thread(target=lambda: frames.extend(_stream_until_error(leader.url)))
    streaming.start()
    time.sleep(1.0)  # the request is decoding
    os.kill(pid or worker.proc.pid, sig)
    lost_at = time.monotonic()
    wait_for(lambda: stack.engine_id(0) not in router_engines(router), 5.0,
             "the leader leaves routing")
    left_after = time.monotonic() - lost_at
    code = leader.proc.wait(10)
    streaming.join(10)
    print(f"\n{sig.name}: the leader left routing after {left_after:.2f}s, exit {code}")
    assert code != 0, leader.log_tail()
    assert any(isinstance(f, engine_api.ErrorFrame) for f in frames), frames[-3:]
    log = leader.log_text()
    # The link watch names the lost worker, unless a collective of the step in flight saw the
    # closed connection first and took the core down itself (seen on 2 cores when the worker
    # pod dies: SIGKILL, or a lost local rank, which ends the pod): then the server says its
    # core died. A stopped worker pod closes nothing, so only the link watch can notice it.
    pod_died = sig == signal.SIGKILL or pid is not None
    assert "worker node rank 1" in log or (pod_died and "the engine core died" in log), \
        log[-2000:]
    if sig == signal.SIGSTOP:
        with contextlib.suppress(ProcessLookupError):  # a local rank dies with its pod
            os.kill(pid or worker.proc.pid, signal.SIGCONT)
    assert worker.proc.wait(10) != 0


def _slow_stack(model: Path, port: int, layout: str = "tp") -> PagodaStack:
    stack = _stack(model, port, layout)  # slow steps: a stream still decodes when the worker goes
    stack.options.engine_args = [[*_group_args(port, layout), "--debug-step-delay-s", "0.05"]]
    return stack


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_a_group_serves_one_engines_tokens_and_a_killed_worker_ends_it(fast_model_dir,
                                                                       layout) -> None:
    """From the LWS environment alone: the tokens of a single-process engine through the
    router and gateway; SIGKILL on the worker takes the leader out of routing; the group,
    started again (as LWS recreates it), serves the same tokens; ``tp``: then SIGSTOP on the
    new worker (a pod that hangs, closing nothing) takes the group out of routing too. ``pp``:
    the worker pod is pipeline stage 0 (the leader the last stage)."""
    expected = _reference(fast_model_dir)
    port = free_port()
    stack = _slow_stack(fast_model_dir, port, layout)
    with _launched(_worker(fast_model_dir, port, layout=layout)) as worker, stack:
        worker.wait_healthy()  # joined, its shard loaded
        assert _complete(stack.base_url, stack.model) == expected
        with urllib.request.urlopen(worker.url + "/health", timeout=5) as r:
            assert json.loads(r.read())["role"] == "worker"
        _lose_worker(stack, worker, signal.SIGKILL)
        with _launched(_worker(fast_model_dir, port, layout=layout)) as again:
            stack.restart_engine(0)
            again.wait_healthy()
            wait_for(lambda: stack.engine_id(0) in router_engines(stack.routers[0].url), 10,
                     "the group is back in routing")
            assert _complete(stack.base_url, stack.model) == expected
            if layout == "tp":  # here, not in a test of its own: one group start less
                _lose_worker(stack, again, signal.SIGSTOP)


def _local_ranks(pid: int) -> list[int]:
    """The tensor-parallel worker processes under ``pid`` (a pod's local ranks; the leader's
    are its engine core's children)."""
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # one that ended meanwhile
            if "services.engine.tp_worker" in child.cmdline():
                found.append(child.pid)
    return found


def test_a_stage_of_two_ranks_per_pod_serves_and_a_lost_local_rank_ends_the_group(
        fast_model_dir) -> None:
    """Two pods of two tensor-parallel ranks each, one pipeline stage per pod (ranks 0-1 the
    leader's, the last stage; ranks 2-3 the worker pod's, stage 0), each pod's process
    starting its one local worker: the tokens of a single-process engine through the router
    and gateway; the worker pod's local rank SIGKILLed ends the worker pod and so the group.
    Started again, the worker pod's local rank SIGSTOPped (its pod's process still heartbeats
    to the leader): its silent link to its pod's process ends that process, and so the group,
    within seconds, not after the leader's step watchdog."""
    expected = _reference(fast_model_dir)
    port = free_port()
    stack = _slow_stack(fast_model_dir, port, "pp_tp")
    with _launched(_worker(fast_model_dir, port, layout="pp_tp")) as worker, stack:
        worker.wait_healthy()
        assert _complete(stack.base_url, stack.model) == expected
        (local,) = _local_ranks(worker.proc.pid)
        assert len(_local_ranks(stack.engines[0].proc.pid)) == 1  # the leader's rank 1
        _lose_worker(stack, worker, signal.SIGKILL, pid=local)
        with _launched(_worker(fast_model_dir, port, layout="pp_tp")) as again:
            stack.restart_engine(0)
            again.wait_healthy()
            (local,) = _local_ranks(again.proc.pid)
            _lose_worker(stack, again, signal.SIGSTOP, pid=local)
            assert "went silent" in again.log_text(), again.log_tail()
