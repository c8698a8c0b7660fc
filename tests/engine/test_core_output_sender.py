"""The engine-core process's output sender: a step never waits on a server that does not read
(the pipe holds about two steps of a 256-request batch), the messages that queue while it
sends go together and in order, a close sends what is queued, and a server gone stops the core
without leaving a step blocked."""

from __future__ import annotations

import multiprocessing
import threading

from services.engine.engine import RequestUpdate
from services.engine.serving import core_ipc
from services.engine.serving.core_loop import CoreOutputs
from services.engine.serving.core_process import OutputSender


def step_outputs(step: int, n: int = 256) -> CoreOutputs:
    """A decode step's outputs for ``n`` requests (about 30 KB pickled)."""
    return CoreOutputs(updates=[
        RequestUpdate(f"cmpl-{i:032x}-0-{step:08x}", [step], [None], False,
                      num_prompt_tokens=500, num_output_tokens=step, arrival_time=1.0,
                      first_scheduled_time=2.0, first_token_time=3.0, max_tokens=256)
        for i in range(n)])


def received(conn) -> list[CoreOutputs]:
    """Every message the reader can read now, lists flattened, in order."""
    out = []
    while conn.poll(0.5):
        msg = core_ipc.decode(conn.recv_bytes())
        out.extend(msg if isinstance(msg, list) else [msg])
    return out


def test_a_step_never_waits_on_a_server_that_does_not_read() -> None:
    read, write = multiprocessing.Pipe(duplex=False)
    sender = OutputSender(write, max_queued=64)
    sender.start()
    steps = 32  # about 1 MB: many times what the pipe holds
    done = threading.Event()

    def step_loop() -> None:
        for step in range(steps):
            sender.send(step_outputs(step))
        done.set()

    threading.Thread(target=step_loop, daemon=True).start()
    assert done.wait(5)  # sent from the step loop itself: blocked at the third step
    got = received(read)  # the server reads late: all of it, in order
    assert [o.updates[0].new_token_ids for o in got] == [[s] for s in range(steps)]
    assert got[5].updates[17] == step_outputs(5).updates[17]
    sender.close()
    read.close()


def test_what_queued_during_a_send_goes_as_one_frame_and_close_sends_the_rest() -> None:
    read, write = multiprocessing.Pipe(duplex=False)
    sender = OutputSender(write)
    for step in range(5):  # queued before the thread runs: one frame of five
        sender.send(step_outputs(step, n=2))
    sender.start()
    assert read.poll(5)
    first = core_ipc.decode(read.recv_bytes())
    assert isinstance(first, list) and len(first) == 5
    sender.send(step_outputs(5, n=2))
    sender.close()  # flushes
    assert not sender._thread.is_alive()
    rest = received(read)
    assert [o.updates[0].new_token_ids for o in [*first, *rest]] == [[s] for s in range(6)]
    sender.send(step_outputs(6, n=2))  # after close: not sent, never blocks
    assert not read.poll(0.2)
    read.close()


def test_a_server_gone_stops_the_core_and_no_step_stays_blocked() -> None:
    read, write = multiprocessing.Pipe(duplex=False)
    stopped = threading.Event()
    sender = OutputSender(write, max_queued=2)
    sender.on_closed = stopped.set
    sender.start()
    read.close()  # the server died
    done = threading.Event()

    def step_loop() -> None:
        for step in range(20):  # well past max_queued
            sender.send(step_outputs(step, n=8))
        done.set()

    threading.Thread(target=step_loop, daemon=True).start()
    assert stopped.wait(5)
    assert done.wait(5)  # the step loop went on: its outputs are dropped, not waited on
    sender.close(timeout=1)


def test_a_message_that_cannot_be_sent_stops_the_core_at_once() -> None:
    """A bug in the outputs (here: a lock in an update) must not leave the steps queueing
    for a sender thread that died: the core stops, and the server sees its pipe close."""
    read, write = multiprocessing.Pipe(duplex=False)
    stopped = threading.Event()
    sender = OutputSender(write, max_queued=2)
    sender.on_closed = stopped.set
    sender.start()
    bad = step_outputs(0, n=1)
    bad.updates[0].kv_transfer_params = {"lock": threading.Lock()}
    sender.send(bad)
    assert stopped.wait(5)
    for step in range(10):  # never blocks
        sender.send(step_outputs(step, n=1))
    read.close()
