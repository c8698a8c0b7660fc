"""The join handshake of a node group: the leader admits each worker node before the process
group forms, and the admitted connection becomes the pair's heartbeat link (``heartbeat``).

    worker -> leader   {"token": <internal credential or "">, "rank": r, "identity": {...}}
    leader -> worker   {"ok": true, "store_port": P, "prefix": <32 hex>}
                     | {"ok": false, "error": "<why, naming each difference>"}

One JSON object per line, at most ``_MAX_MESSAGE`` bytes, read within ``_HANDSHAKE_S``.

What a stranger who can reach the rendezvous port meets (read as an attacker would):

* With an internal credential configured (``PAGODA_INTERNAL_TOKENS``), a hello without one of
  its tokens is refused before anything else is looked at; nothing of the leader's identity
  is told to it.
* The torch rendezvous store (``TCPStore``: no authentication of its own) is reached only
  under a random 128-bit key prefix that only admitted workers learn, so a stranger who finds
  the store's port cannot register as a rank.
* A rank is admitted once; the door closes once every rank is in. Each connection is heard
  on its own thread and dropped after ``_HANDSHAKE_S``, so a peer that connects and says
  nothing delays no one.

A worker whose identity (model, weights digest, dtype, Pagoda version, engine flags) differs
from the leader's is refused with the differences named: the leader logs them and keeps
waiting for the right worker; the worker exits non-zero with the same message.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from services.common import internal_auth
from services.engine.parallel.node_group import NodeGroup

logger = logging.getLogger(__name__)

TOKENS_ENV = "PAGODA_INTERNAL_TOKENS"
_MAX_MESSAGE = 64 * 1024
_HANDSHAKE_S = 10.0
_RETRY_S = 0.5  # a worker that starts before its leader listens tries again this often
_ACCEPT_POLL_S = 0.2

Identity = Mapping[str, str]


class JoinRefused(RuntimeError):
    """The leader refused this worker (or a worker was refused): the message says why."""


@dataclass(frozen=True, slots=True)
class Admission:
    """What an admitted worker learns: where the rendezvous store is, and its key prefix."""

    store_port: int
    prefix: str
    link: socket.socket  # the admitted connection: the heartbeat link from now on


def internal_tokens(env: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The internal credential's tokens (the first is the one sent, any is accepted, so tokens
    rotate): the engine server puts its resolved credential, file included, in the
    environment (``internal_auth.export``) before a node group forms."""
    return internal_auth.read_tokens(None, env)


def _accepts(tokens: tuple[str, ...], given: object) -> bool:
    # No tokens only with --insecure-no-internal-auth: the server refuses to start otherwise.
    if not tokens:
        return True
    if not isinstance(given, str):
        return False
    return internal_auth.InternalCredential(tokens).accepts(f"Bearer {given}")


def differences(leader: Identity, worker: Identity) -> list[str]:
    """Each key whose values differ, with both values: ``dtype (leader 'float32', worker
    'bfloat16')``."""
    return [f"{k} (leader {leader.get(k)!r}, worker {worker.get(k)!r})"
            for k in sorted(set(leader) | set(worker)) if leader.get(k) != worker.get(k)]


# -- the leader ---------------------------------------------------------------------------


class Door:
    """The leader's rendezvous listener, open until every worker rank is admitted."""

    def __init__(self, nodes: NodeGroup) -> None:
        self.nodes = nodes
        self.tokens = internal_tokens()
        self.listener = _listen(nodes.master_addr, nodes.master_port)

    def admit(self, identity: Identity, store_port: int, prefix: str,
              timeout_s: float) -> dict[int, socket.socket]:
        """Admits ranks 1..N-1 (each once); returns their links by rank. ``TimeoutError``
        when they are not all in within ``timeout_s``. Each knock is heard on its own thread,
        so a peer that connects and says nothing delays no one."""
        wanted = frozenset(range(1, self.nodes.nnodes))
        admitted: dict[int, socket.socket] = {}
        lock = threading.Lock()
        deadline = time.monotonic() + timeout_s
        self.listener.settimeout(_ACCEPT_POLL_S)
        try:
            while True:
                with lock:
                    missing = sorted(wanted - set(admitted))
                if not missing:
                    return dict(admitted)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"worker nodes {missing} did not join within "
                                       f"{timeout_s:.0f}s")
                try:
                    conn, peer = self.listener.accept()
                except TimeoutError:
                    continue
                threading.Thread(target=self._handshake, name="node-join", daemon=True,
                                 args=(conn, peer, identity, (store_port, prefix), wanted,
                                       admitted, lock)).start()
        except BaseException:
            with lock:
                for conn in admitted.values():
                    conn.close()
            raise
        finally:
            self.listener.close()  # nobody else may knock once the group is whole

    def _handshake(self, conn: socket.socket, peer: object, identity: Identity,
                   store: tuple[int, str], wanted: frozenset[int],
                   admitted: dict[int, socket.socket], lock: threading.Lock) -> None:
        """One knock: the rank is claimed and answered under ``lock`` (never twice)."""
        conn.settimeout(_HANDSHAKE_S)
        try:
            hello = _receive(conn)
            with lock:
                verdict = _judge(hello, identity, self.tokens, wanted - set(admitted))
                if verdict is None:
                    _send(conn, {"ok": True, "store_port": store[0], "prefix": store[1]})
                    conn.settimeout(None)
                    admitted[hello["rank"]] = conn
                    logger.info("worker node rank=%d joined from %s", hello["rank"], peer)
                    return
            logger.error("refused a worker node from %s: %s", peer, verdict)
            _send(conn, {"ok": False, "error": verdict})
        except (OSError, ValueError) as exc:
            logger.warning("a join from %s failed: %s", peer, exc)
        conn.close()


def _judge(hello: dict, identity: Identity, tokens: tuple[str, ...],
           open_ranks: set[int]) -> str | None:
    """Why ``hello`` is refused, or None to admit it."""
    if not _accepts(tokens, hello.get("token")):
        return "the internal credential was missing or not accepted"
    rank = hello.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank not in open_ranks:
        return f"node rank {rank!r} is not one still expected ({sorted(open_ranks)})"
    theirs = hello.get("identity")
    if not isinstance(theirs, dict):
        return "the hello has no identity"
    diff = differences(identity, theirs)
    if diff:
        return f"node rank {rank} differs from the leader: " + "; ".join(diff)
    return None


def new_prefix() -> str:
    return secrets.token_hex(16)


# -- a worker -----------------------------------------------------------------------------


def request_admission(nodes: NodeGroup, identity: Identity, timeout_s: float) -> Admission:
    """Knocks at the leader (again every ``_RETRY_S`` until it listens, within ``timeout_s``);
    ``JoinRefused`` with the leader's reason when refused."""
    deadline = time.monotonic() + timeout_s
    hello = {"token": next(iter(internal_tokens()), ""), "rank": nodes.node_rank,
             "identity": dict(identity)}
    while True:
        try:
            conn = socket.create_connection((nodes.master_addr, nodes.master_port),
                                            timeout=_HANDSHAKE_S)
            break
        except OSError as exc:
            if time.monotonic() + _RETRY_S > deadline:
                raise TimeoutError(f"the leader {nodes.master_addr}:{nodes.master_port} did "
                                   f"not answer within {timeout_s:.0f}s: {exc}") from exc
            time.sleep(_RETRY_S)
    try:
        _send(conn, hello)
        answer = _receive(conn)
    except BaseException:
        conn.close()
        raise
    if answer.get("ok") is not True:
        conn.close()
        raise JoinRefused(f"the leader refused this worker: {answer.get('error', answer)}")
    conn.settimeout(None)
    return Admission(int(answer["store_port"]), str(answer["prefix"]), conn)


# -- the wire -----------------------------------------------------------------------------


def _listen(host: str, port: int) -> socket.socket:
    """Listens on the leader's own address (``host``), or on every interface when that address
    is not this host's (a name the cluster resolves elsewhere, e.g. behind a Service)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((socket.gethostbyname(host), port))
    except OSError:
        logger.info("rendezvous: %s is not an address of this host; listening on all", host)
        sock.bind(("", port))
    sock.listen(16)
    return sock


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def _receive(conn: socket.socket) -> dict:
    """One line, read a byte at a time: the heartbeats that follow an answer on the same
    connection must stay unread for the link (a handshake is read once, and is short)."""
    data = bytearray()
    while not data.endswith(b"\n"):
        byte = conn.recv(1)
        if not byte:
            raise ValueError("the peer closed the connection mid-handshake")
        data += byte
        if len(data) > _MAX_MESSAGE:
            raise ValueError(f"handshake message over {_MAX_MESSAGE} bytes")
    message = json.loads(data)
    if not isinstance(message, dict):
        raise ValueError("handshake message is not a JSON object")  # noqa: TRY004 -- peer input
    return message
