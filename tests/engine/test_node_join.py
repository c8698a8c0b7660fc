"""The node group's join handshake and heartbeat links, on loopback sockets (no model):
a worker with the leader's identity is admitted and learns the store's secret prefix; another
identity is refused with each difference named; a stranger without the internal credential
learns nothing; a link that closes or goes silent is reported, a goodbye is not."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from services.engine.parallel import node_join
from services.engine.parallel.heartbeat import SILENCE_S, Heartbeats
from services.engine.parallel.node_group import NodeGroup
from tests.support.redis_server import free_port

IDENTITY = {"model": "m", "dtype": "float32", "weights digest": "abc"}


def _admit_in_thread(nodes: NodeGroup, out: dict) -> threading.Thread:
    door = node_join.Door(nodes)  # listening before the workers knock

    def run() -> None:
        try:
            out["links"] = door.admit(IDENTITY, 1234, "p" * 32, timeout_s=20)
        except Exception as exc:  # noqa: BLE001 -- handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_the_leader_admits_the_right_worker_and_refuses_others(monkeypatch, caplog) -> None:
    monkeypatch.setenv(node_join.TOKENS_ENV, "new-token-0123456789,old-token-0123456789")
    leader = NodeGroup(2, 0, "127.0.0.1", free_port())
    out: dict = {}
    thread = _admit_in_thread(leader, out)
    worker = NodeGroup(2, 1, leader.master_addr, leader.master_port)

    monkeypatch.setenv(node_join.TOKENS_ENV, "wrong-token-0123456789")
    with pytest.raises(node_join.JoinRefused) as refused:
        node_join.request_admission(worker, IDENTITY, 10)
    assert "credential" in str(refused.value) and "float32" not in str(refused.value)

    monkeypatch.setenv(node_join.TOKENS_ENV, "old-token-0123456789")  # any one is accepted
    with pytest.raises(node_join.JoinRefused, match=r"dtype \(leader 'float32', worker 'bf"):
        node_join.request_admission(worker, {**IDENTITY, "dtype": "bfloat16"}, 10)
    with pytest.raises(node_join.JoinRefused, match="node rank 5 is not one still expected"):
        node_join.request_admission(NodeGroup(2, 5, "127.0.0.1", leader.master_port),
                                    IDENTITY, 10)

    mute = socket.create_connection(("127.0.0.1", leader.master_port))  # says nothing
    start = time.monotonic()
    admission = node_join.request_admission(worker, IDENTITY, 10)
    assert time.monotonic() - start < 2  # the mute peer held no one up
    thread.join(10)
    mute.close()
    assert (admission.store_port, admission.prefix) == (1234, "p" * 32)
    assert set(out["links"]) == {1}
    assert "differs from the leader" in caplog.text
    admission.link.close()
    out["links"][1].close()
    with pytest.raises(OSError):  # the door is closed once the group is whole
        socket.create_connection(("127.0.0.1", leader.master_port), timeout=2)


def test_a_silent_peer_is_not_admitted_forever() -> None:
    leader = NodeGroup(2, 0, "127.0.0.1", free_port())
    with pytest.raises(TimeoutError, match=r"worker nodes \[1\] did not join"):
        node_join.Door(leader).admit(IDENTITY, 1, "p", timeout_s=0.5)


def _links() -> tuple[Heartbeats, socket.socket, list[str]]:
    ours, theirs = socket.socketpair()
    lost: list[str] = []
    return Heartbeats({"worker node rank 1": ours}, lost.append).start(), theirs, lost


def _wait(lost: list[str], seconds: float) -> float:
    start = time.monotonic()
    while not lost and time.monotonic() - start < seconds:
        time.sleep(0.02)
    return time.monotonic() - start


def test_a_closed_link_is_lost_at_once_and_a_silent_one_within_seconds() -> None:
    links, peer, lost = _links()
    peer.close()
    assert _wait(lost, 2) < 1 and "closed its connection" in lost[0]
    links.close()

    links, peer, lost = _links()  # the peer never answers (a stopped process)
    took = _wait(lost, SILENCE_S + 2)
    assert lost and "went silent" in lost[0] and SILENCE_S <= took < SILENCE_S + 1, took
    links.close()
    peer.close()


def test_a_goodbye_is_not_a_loss() -> None:
    links, peer, lost = _links()
    peer.sendall(b"!")
    peer.close()
    time.sleep(0.5)
    assert not lost
    links.close()
