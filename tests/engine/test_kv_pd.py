"""Disaggregated prefill/decode with PagodaPDConnector: two in-process engines, the prefill one
serving its held blocks on a loopback transfer port. The decode engine's greedy output equals
one aggregated engine's while it computes only the prompt's tail; a pull that fails costs a
recompute; held blocks are freed once pulled or expired; the transfer port answers attackers
(no or a wrong credential, an oversized frame, an unknown transfer id, a slow peer) by
refusing."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.engine import LLM, SamplingParams
from services.engine.engine import LLMEngine

BS = 16
TOKEN = "pd-test-token-0123456789abcdef"
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PREFILL = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def _llm(model: Path, role: str, **extra: Any) -> LLM:
    return LLM(str(model), num_blocks=160, block_size=BS, max_num_seqs=16, enable_lora=True,
               max_loras=1, kv_transfer_config={
        "kv_connector": "PagodaPDConnector", "kv_role": role, "kv_transfer_timeout": 2.0,
        "kv_connector_extra_config": {"read_timeout_s": 0.5, "max_connections": 3,
                                      "pull_threads": 3, **extra}})


@pytest.fixture(scope="module")
def engines(fast_model_dir: Path) -> Iterator[tuple[LLMEngine, LLMEngine]]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGODA_INTERNAL_TOKENS", TOKEN)
        prefill, decode = _llm(fast_model_dir, "kv_producer"), _llm(fast_model_dir, "kv_both")
        yield prefill.engine, decode.engine
        prefill.shutdown()
        decode.shutdown()


def _run(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams,
         kv: dict | None = None, salt: str | None = None,
         lora: str | None = None) -> tuple[list[int], Any, list[int]]:
    """(output tokens, the finished request, tokens computed per step)."""
    req = engine.add_request(rid, prompt, params, salt, lora_request=lora, kv_transfer_params=kv)
    tokens, steps = [], []
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        tokens += [t for u in engine.step() for t in u.new_token_ids]
        steps.append(engine.last_step_tokens)
    return tokens, req, [n for n in steps if n]


def _prompt(base: int, n: int) -> list[int]:
    return [base + (i * 13) % 900 for i in range(n)]


def _pd(prefill: LLMEngine, decode: LLMEngine, rid: str, prompt: list[int],
        salt: str | None = None, edit: dict | None = None) -> tuple[list[int], Any, list[int]]:
    _, p_req, _ = _run(prefill, rid, prompt, PREFILL, {"do_remote_decode": True}, salt)
    params = dict(p_req.kv_transfer_params)
    assert params["do_remote_prefill"] is True and "remote_block_ids" not in params
    return _run(decode, rid, prompt, GREEDY, {**params, **(edit or {})}, salt)


def _all_free(engine: LLMEngine, timeout: float = 5.0) -> bool:
    bm, deadline = engine.block_manager, time.monotonic() + timeout
    while time.monotonic() < deadline:
        engine.step()
        if bm.num_free_blocks == bm.num_total_blocks:
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("n", [3 * BS + 5, 4 * BS, 2 * BS + 1])
def test_decode_engine_matches_one_engine_and_computes_only_the_tail(
        engines: tuple[LLMEngine, LLMEngine], n: int) -> None:
    prefill, decode = engines
    prompt = _prompt(n, n)
    alone, _, _ = _run(decode, f"alone{n}", prompt, GREEDY)
    assert decode.block_manager.reset_prefix_cache()
    tokens, req, steps = _pd(prefill, decode, f"pd{n}", prompt)
    assert tokens == alone
    loaded = (n - 1) // BS * BS  # never the last token
    assert req.num_cached_tokens == loaded and steps[0] == n - loaded
    assert _all_free(prefill) and decode.block_manager.reset_prefix_cache()


def test_a_prefix_the_prefill_engine_had_cached(engines: tuple[LLMEngine, LLMEngine]) -> None:
    prefill, decode = engines
    shared = _prompt(61, 2 * BS)
    prompt = [*shared, *_prompt(62, BS + 7)]
    alone, _, _ = _run(decode, "cached-ref", prompt, GREEDY)
    decode.block_manager.reset_prefix_cache()
    _run(prefill, "cached-warm", shared, PREFILL)  # the prefill engine holds the first blocks
    _, p_req, _ = _run(prefill, "cached", prompt, PREFILL, {"do_remote_decode": True})
    assert p_req.num_cached_tokens == 2 * BS and p_req.kv_transfer_params["remote_num_blocks"] == 3
    tokens, req, _ = _run(decode, "cached", prompt, GREEDY, dict(p_req.kv_transfer_params))
    assert tokens == alone and req.num_cached_tokens == 3 * BS
    assert _all_free(prefill)
    decode.block_manager.reset_prefix_cache()


def test_a_lora_adapter(engines: tuple[LLMEngine, LLMEngine], fast_model_dir: Path,
                       tmp_path: Path) -> None:
    """The adapter is in the chain: P/D under it equals one engine under it, and a pull under
    the base model of a prompt held under the adapter is refused (recomputed)."""
    from services.engine.lora.manager import STATIC
    from tests.support.lora import write_adapter

    prefill, decode = engines
    adapter = write_adapter(fast_model_dir, tmp_path / "sql", seed=3, r=4)
    for engine in engines:
        engine.lora.load("sql", str(adapter), STATIC)
    prompt = _prompt(71, 3 * BS + 5)
    want = [decode.add_request("lora-ref", prompt, GREEDY, lora_request="sql")]
    alone = []
    while decode.has_unfinished_requests():
        alone += [t for u in decode.step() for t in u.new_token_ids]
    base, _, _ = _run(decode, "lora-base", prompt, GREEDY)
    assert alone != base and want  # the adapter changes the output
    decode.block_manager.reset_prefix_cache()
    for rid, decode_lora in (("lora-pd", "sql"), ("lora-cross", None)):
        prefill.add_request(rid, prompt, PREFILL, lora_request="sql",
                            kv_transfer_params={"do_remote_decode": True})
        params = None
        while prefill.has_unfinished_requests():
            params = next((u.kv_transfer_params for u in prefill.step() if u.finished), params)
        req = decode.add_request(rid, prompt, GREEDY, lora_request=decode_lora,
                                 kv_transfer_params=params)
        tokens = []
        while decode.has_unfinished_requests():
            tokens += [t for u in decode.step() for t in u.new_token_ids]
        if decode_lora:
            assert tokens == alone and req.num_cached_tokens == 3 * BS
        else:  # another chain: the server refuses, the base model's answer is computed
            assert tokens == base and req.num_cached_tokens == 0
        decode.block_manager.reset_prefix_cache()
    assert _all_free(prefill)


def test_two_tenants_salts_never_share(engines: tuple[LLMEngine, LLMEngine]) -> None:
    prefill, decode = engines
    prompt = _prompt(7, 3 * BS + 2)
    a, _, _ = _pd(prefill, decode, "ta", prompt, salt="tenant-a")
    _, p_req, _ = _run(prefill, "tb", prompt, PREFILL, {"do_remote_decode": True}, "tenant-b")
    assert p_req.num_cached_tokens == 0  # the prefill engine did not reuse tenant a's blocks
    b, d_req, _ = _run(decode, "tb", prompt, GREEDY, dict(p_req.kv_transfer_params), "tenant-b")
    assert a == b and d_req.num_cached_tokens == 3 * BS  # pulled again, not tenant a's pool
    _, c_req, _ = _run(decode, "tc", prompt, GREEDY, None, "tenant-c")
    assert c_req.num_cached_tokens == 0
    assert _all_free(prefill)
    decode.block_manager.reset_prefix_cache()


def _signed(params: dict, **edit: Any) -> dict:
    """The params with ``edit`` applied and signed again under the test's token: what only a
    holder of the credential can write."""
    from services.common import internal_mac
    from services.common.internal_auth import InternalCredential
    from services.engine.kv_connector.pd import GRANT

    p = {**params, **edit}
    p["remote_signature"] = internal_mac.sign(
        InternalCredential((TOKEN,)), GRANT, p["remote_engine_id"], p["remote_host"],
        p["remote_port"], p["remote_transfer_id"], p["remote_num_blocks"], p["kv_layout"],
        p["remote_expires"])
    return p


def test_a_failed_pull_recomputes(engines: tuple[LLMEngine, LLMEngine]) -> None:
    prefill, decode = engines
    prompt = _prompt(11, 3 * BS + 4)
    alone, _, _ = _run(decode, "ref", prompt, GREEDY)
    decode.block_manager.reset_prefix_cache()
    with socket.socket() as dead:  # a port nobody listens on: the prefill engine is gone
        dead.bind(("127.0.0.1", 0))
        port = dead.getsockname()[1]
    before = decode.transfer_stats.snapshot().failures
    for rid, edit, reason in (
            ("gone", lambda p: _signed(p, remote_port=port), "connection"),
            ("unknown", lambda p: _signed(p, remote_transfer_id="x" * 32), "refused"),
            ("layout", lambda p: {**p, "kv_layout": "another model"}, "layout"),
            ("unsigned", lambda p: {**p, "remote_port": port}, "unsigned"),
            ("expired", lambda p: _signed(p, remote_expires=int(time.time()) - 1), "expired")):
        _, p_req, _ = _run(prefill, rid, prompt, PREFILL, {"do_remote_decode": True})
        tokens, req, _ = _run(decode, rid, prompt, GREEDY, edit(dict(p_req.kv_transfer_params)))
        assert tokens == alone and req.num_cached_tokens == 0, rid
        after = decode.transfer_stats.snapshot().failures
        assert after.get(reason, 0) == before.get(reason, 0) + 1, (rid, after)
        before = after
        decode.block_manager.reset_prefix_cache()
    assert _all_free(prefill, timeout=3.0)  # the unpulled ones too, once expired
    assert prefill.transfer_stats.snapshot().expired >= 5


def test_held_blocks_are_freed_after_pulls_and_after_the_timeout(
        engines: tuple[LLMEngine, LLMEngine]) -> None:
    prefill, decode = engines
    for i in range(12):
        _pd(prefill, decode, f"many{i}", _prompt(100 + i, 2 * BS + 3))
        decode.block_manager.reset_prefix_cache()
    assert _all_free(prefill, timeout=0.5)  # pulled: freed at once, before any expiry
    _run(prefill, "never", _prompt(5, 2 * BS + 3), PREFILL, {"do_remote_decode": True})
    prefill.step()
    assert prefill.block_manager.num_free_blocks < prefill.block_manager.num_total_blocks
    assert _all_free(prefill, timeout=3.0)  # never pulled: given up after the timeout
    assert len(prefill.kv_connector.held) == 0


def _connect(engine: LLMEngine) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", engine.kv_connector.server.port), timeout=3)
    return s


def _frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def _answer(s: socket.socket) -> dict | None:
    try:
        head = s.recv(4)
    except (ConnectionResetError, TimeoutError):
        return None
    if len(head) < 4:
        return None  # closed without an answer
    (n,) = struct.unpack(">I", head)
    return json.loads(s.recv(n))


def _hello(s: socket.socket, token: str) -> str:
    """The puller's handshake by hand: checks the server's proof, returns the client's."""
    from services.common import internal_mac
    from services.common.internal_auth import InternalCredential

    mine = "ab" * 16
    s.sendall(_frame(json.dumps({"nonce": mine}).encode()))
    theirs = _answer(s)
    cred = InternalCredential((TOKEN,))
    assert internal_mac.signed(cred, "pagoda-kv/2 server proof", theirs["proof"], mine,
                               theirs["nonce"])
    return internal_mac.sign(InternalCredential((token,)), "pagoda-kv/2 client proof", mine,
                             theirs["nonce"])


def test_the_transfer_port_refuses_attackers(engines: tuple[LLMEngine, LLMEngine]) -> None:
    prefill, _ = engines
    prompt = _prompt(9, 3 * BS)
    _, p_req, _ = _run(prefill, "target", prompt, PREFILL, {"do_remote_decode": True})
    tid = p_req.kv_transfer_params["remote_transfer_id"]
    layout = p_req.kv_transfer_params["kv_layout"]
    last = p_req.block_hashes[0].hex()
    ask = {"transfer_id": tid, "first": 0, "count": 1, "last_hash": last, "layout": layout}
    for proof in (None, "0" * 64, TOKEN, f"Bearer {TOKEN}"):  # no proof; the token itself
        with _connect(prefill) as s:
            _hello(s, TOKEN)
            s.sendall(_frame(json.dumps({**ask, "proof": proof}).encode()))
            assert _answer(s) == {"ok": False, "error": "unauthorized"}
    with _connect(prefill) as s:  # a proof under another token
        proof = _hello(s, "another-token-0123456789abcdef")
        s.sendall(_frame(json.dumps({**ask, "proof": proof}).encode()))
        assert _answer(s) == {"ok": False, "error": "unauthorized"}
    with _connect(prefill) as s:  # oversized hello: cut off unanswered
        s.sendall(struct.pack(">I", 1 << 30))
        assert _answer(s) is None
    wrong = p_req.block_hashes[1].hex()  # another prompt's (or tenant's) chain
    for body, error in (({**ask, "transfer_id": "guess"}, "unknown transfer id"),
                        ({**ask, "count": 99}, "blocks out of the transfer's range"),
                        ({**ask, "layout": "x"}, "KV layout mismatch"),
                        ({**ask, "last_hash": wrong}, "another prompt's blocks"),
                        ({"block_ids": [0, 1, 2]}, "transfer_id, last_hash")):
        with _connect(prefill) as s:
            proof = _hello(s, TOKEN)
            s.sendall(_frame(json.dumps({**body, "proof": proof}).encode()))
            answer = _answer(s)
            assert answer is not None and answer["ok"] is False
            assert answer["error"].startswith(error), answer
    started = time.monotonic()
    with _connect(prefill) as s:  # slow: half a hello, then nothing
        s.sendall(_frame(b'{"nonce": "ab"}')[:6])
        assert _answer(s) is None
    assert time.monotonic() - started < 2.0  # read_timeout_s 0.5
    idle = [_connect(prefill) for _ in range(3)]  # max_connections 3: the fourth is refused
    try:
        time.sleep(0.1)
        with _connect(prefill) as s:
            s.sendall(_frame(json.dumps({"nonce": "ab" * 16}).encode()))
            assert _answer(s) is None
    finally:
        for s in idle:
            s.close()
    time.sleep(0.7)  # the idle ones timed out: slots free again, a real pull still works
    _, p_req, _ = _run(prefill, "target2", prompt, PREFILL, {"do_remote_decode": True})
    with _connect(prefill) as s:
        proof = _hello(s, TOKEN)
        s.sendall(_frame(json.dumps({**ask, "proof": proof, "transfer_id":
                                     p_req.kv_transfer_params["remote_transfer_id"]}).encode()))
        assert _answer(s) == {"ok": True, "count": 1}
    assert _all_free(prefill)


def test_a_puller_never_sends_the_credential(engines: tuple[LLMEngine, LLMEngine]) -> None:
    """Exfiltration: params that name an attacker's server. Unsigned, the engine never
    connects; signed (a leaked grant), it sends a nonce, gets no proof back, and stops: the
    server never sees the token or anything derived from it alone."""
    prefill, decode = engines
    prompt = _prompt(21, 3 * BS + 1)
    alone, _, _ = _run(decode, "exf-ref", prompt, GREEDY)
    decode.block_manager.reset_prefix_cache()
    heard: list[bytes] = []
    with socket.create_server(("127.0.0.1", 0)) as fake:
        fake.settimeout(0.05)
        port = fake.getsockname()[1]
        for rid, forge in (("exf1", lambda p: {**p, "remote_port": port}),
                           ("exf2", lambda p: _signed(p, remote_port=port))):
            _, p_req, _ = _run(prefill, rid, prompt, PREFILL, {"do_remote_decode": True})
            decode.add_request(rid, prompt, GREEDY,
                               kv_transfer_params=forge(dict(p_req.kv_transfer_params)))
            tokens, deadline = [], time.monotonic() + 30
            while decode.has_unfinished_requests():
                assert time.monotonic() < deadline
                tokens += [t for u in decode.step() for t in u.new_token_ids]
                try:
                    conn, _ = fake.accept()
                except TimeoutError:
                    continue
                with conn:  # answers the hello with a made-up proof
                    conn.settimeout(2)
                    heard.append(conn.recv(65536))
                    conn.sendall(_frame(json.dumps({"nonce": "cd" * 16,
                                                    "proof": "0" * 64}).encode()))
                    while chunk := conn.recv(65536):
                        heard.append(chunk)
            assert tokens == alone, rid
            decode.block_manager.reset_prefix_cache()
    wire = b"".join(heard)
    assert wire and TOKEN.encode() not in wire and b"Bearer" not in wire
    (n,) = struct.unpack(">I", wire[:4])
    assert list(json.loads(wire[4:4 + n])) == ["nonce"] and len(wire) == 4 + n  # nothing more
    assert decode.transfer_stats.snapshot().failures.get("unauthorized", 0) >= 1
    assert _all_free(prefill, timeout=3.0)


def test_the_connector_starts_only_with_a_credential(fast_model_dir: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from services.common.internal_auth import MissingCredential

    monkeypatch.delenv("PAGODA_INTERNAL_TOKENS", raising=False)
    with pytest.raises(MissingCredential):
        _llm(fast_model_dir, "kv_producer")
    with pytest.raises(ValueError, match="extra_config.portt is not a key"):
        _llm(fast_model_dir, "kv_producer", portt=1)


def test_kv_transfer_params_on_the_engine_api_are_checked_where_they_enter(
        engines: tuple[LLMEngine, LLMEngine]) -> None:
    from services.protocol.engine_api import FinishedFrame, FrameDecoder, GenerateRequest
    from services.protocol.wire import BadRequest

    params = {"do_remote_prefill": True, "remote_port": 5, "remote_host": "10.0.0.1"}
    req = GenerateRequest("r", [1, 2], kv_transfer_params=params)
    assert GenerateRequest.from_msgpack(req.to_msgpack()).kv_transfer_params == params
    for bad in ([1], {"a": {"nested": 1}}, {"a": "x" * 600}, {str(i): i for i in range(40)},
                {"a": float("nan")}):
        with pytest.raises(BadRequest) as refused:
            GenerateRequest.from_dict({"request_id": "r", "prompt_token_ids": [1],
                                       "kv_transfer_params": bad})
        assert refused.value.param == "kv_transfer_params"
    frame = FinishedFrame("length", None, 2, 1, 0, params)
    assert FrameDecoder().feed(frame.to_msgpack()) == [frame]
    assert FrameDecoder().feed(FinishedFrame("stop", None, 2, 1, 0).to_msgpack())[0] \
        .kv_transfer_params is None
    prefill, decode = engines
    with pytest.raises(BadRequest, match="kv_transfer_params must be an object"):
        prefill.add_request("bad", [1, 2, 3], PREFILL, kv_transfer_params=[1])  # type: ignore
    # The last update carries the connector's params, never the client's echoed back.
    prefill.add_request("last", _prompt(3, 2 * BS + 1), PREFILL, kv_transfer_params={
        "do_remote_decode": True})
    updates = []
    while prefill.has_unfinished_requests():
        updates += prefill.step()
    assert all(u.kv_transfer_params is None for u in updates if not u.finished)
    assert updates[-1].kv_transfer_params["remote_num_blocks"] == 2
    decode.add_request("plain", [1, 2, 3], PREFILL, kv_transfer_params={"x": 1})
    while decode.has_unfinished_requests():
        updates = decode.step()
    assert updates[-1].finished and updates[-1].kv_transfer_params is None
    assert _all_free(prefill)


class _FaultyServer:
    """A transfer port that proves the credential, reads the ask, then stalls (``slow``),
    sends half a block and hangs up (``cut``) or sends a block that fails its checksum
    (``corrupt``)."""

    def __init__(self, mode: str) -> None:
        self.mode, self.sock = mode, socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        from services.common.internal_auth import InternalCredential
        from services.engine.kv_connector import pd_wire

        with conn:
            try:
                deadline = time.monotonic() + 5
                pd_wire.server_hello(conn, InternalCredential((TOKEN,)), deadline)
                ask = pd_wire.recv_json(conn, deadline)
                pd_wire.send_json(conn, {"ok": True, "count": ask["count"]})
                if self.mode == "cut":
                    conn.sendall(struct.pack(">I", 1 << 16) + b"\0" * 100)
                elif self.mode == "corrupt":  # a frame whose checksum does not match
                    conn.sendall(struct.pack(">I", 16) + b"\1" * 16)
                    conn.settimeout(5)
                    conn.recv(1)
                else:
                    conn.settimeout(5)
                    conn.recv(1)  # until the puller gives up
            except (OSError, pd_wire.WireError):
                pass

    def close(self) -> None:
        self.sock.close()


WAVES = 63  # of 16 requests: 1,008


def test_no_leak_after_a_thousand_requests_with_a_fifth_faulted(
        engines: tuple[LLMEngine, LLMEngine]) -> None:
    prefill, decode = engines
    prompts = [_prompt(300 + i, 2 * BS + 1 + i % 3) for i in range(8)]
    short = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    want = {}
    for i, prompt in enumerate(prompts):
        want[i] = _run(decode, f"leak-ref{i}", prompt, short)[0]
    slow, cut = _FaultyServer("slow"), _FaultyServer("cut")
    connector = decode.kv_connector
    min_pull_s, connector.min_pull_s = connector.min_pull_s, 0.05
    faults = {"refused": lambda p: _signed(p, remote_transfer_id="y" * 32),
              "slow": lambda p: _signed(p, remote_port=slow.port),
              "cut": lambda p: _signed(p, remote_port=cut.port),
              "never pulled": lambda p: None}
    kinds = list(faults)
    try:
        for wave in range(WAVES):
            rids = [f"leak{wave}-{i}" for i in range(16)]
            for i, rid in enumerate(rids):
                prefill.add_request(rid, prompts[i % 8], PREFILL,
                                    kv_transfer_params={"do_remote_decode": True})
            params = {}
            while prefill.has_unfinished_requests():
                params.update({u.request_id: u.kv_transfer_params for u in prefill.step()
                               if u.finished})
            for i, rid in enumerate(rids):
                n = wave * 16 + i
                kv = params[rid] if n % 5 else faults[kinds[n // 5 % 4]](params[rid])
                decode.add_request(rid, prompts[i % 8], short, kv_transfer_params=kv)
            got: dict[str, list[int]] = {rid: [] for rid in rids}
            deadline = time.monotonic() + 30
            while decode.has_unfinished_requests():
                assert time.monotonic() < deadline
                for u in decode.step():
                    got[u.request_id] += u.new_token_ids
            assert [got[rid] for rid in rids] == [want[i % 8] for i in range(16)], wave
            assert decode.block_manager.reset_prefix_cache()  # the next wave pulls again
    finally:
        connector.min_pull_s = min_pull_s
        slow.close()
        cut.close()
    assert _all_free(prefill, timeout=5.0) and len(prefill.kv_connector.held) == 0
    assert not prefill.scheduler._held and not decode.scheduler.loading
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_total_blocks
    assert not connector._tried and connector._arrived.empty()
    failures = decode.transfer_stats.snapshot().failures
    # Every fault was met (a loaded machine may turn some into "expired" or "timeout").
    assert failures.get("refused") and failures.get("slower_than_recompute")
    assert failures.get("connection") or failures.get("protocol")  # cut mid-stream
    assert sum(failures.values()) >= WAVES * 16 // 5 * 3 // 4  # the never-pulled aside


def test_a_prefix_pulled_from_a_peer_matches_and_never_crosses_tenants(
        engines: tuple[LLMEngine, LLMEngine]) -> None:
    """The decode engine pulls by chain hash the prefix the other engine has cached from an
    ordinary request: greedy output equal, only the tail computed; under another tenant's
    salt the peer has none of it (the chain differs), so all is computed."""
    peer, puller = engines
    prompt = _prompt(41, 4 * BS + 3)
    alone, _, _ = _run(puller, "peer-ref", prompt, GREEDY, salt="tenant-a")
    puller.block_manager.reset_prefix_cache()
    _run(peer, "peer-warm", prompt, PREFILL, salt="tenant-a")  # cached on the peer
    ask = {"pull_prefix_from": {"engine_id": "peer", "blocks": 4,
                                "address": f"127.0.0.1:{peer.kv_connector.server.port}"}}
    stop = threading.Event()

    def idle_peer() -> None:  # the server's core loop does this while idle
        while not stop.wait(0.01):
            peer.poll_kv_transfers()

    threading.Thread(target=idle_peer, daemon=True).start()
    try:
        tokens, req, steps = _run(puller, "peer-pull", prompt, GREEDY, ask, salt="tenant-a")
        assert tokens == alone and req.num_cached_tokens == 4 * BS and steps[0] == 3
        puller.block_manager.reset_prefix_cache()
        tokens, req, _ = _run(puller, "peer-other", prompt, GREEDY, ask, salt="tenant-b")
        assert req.num_cached_tokens == 0  # tenant b's chain: the peer returned nothing
        deadline = time.monotonic() + 2
        while peer.kv_connector.peers.held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert peer.kv_connector.peers.held == 0  # unpinned once read
    finally:
        stop.set()
    puller.block_manager.reset_prefix_cache()
    assert peer.block_manager.num_free_blocks == peer.block_manager.num_total_blocks


@pytest.fixture(scope="module")
def host_peer(fast_model_dir: Path, engines: tuple[LLMEngine, LLMEngine]) -> Iterator[LLM]:
    """An engine with a host tier and a 24-block pool (a few prompts evict the first one's
    blocks to host memory) that serves peers; the internal token is set while ``engines``
    lives."""
    llm = LLM(str(fast_model_dir), num_blocks=24, block_size=BS, max_num_seqs=4,
              kv_offloading_size=0.01, kv_transfer_config={
        "kv_connector": "PagodaPDConnector", "kv_role": "kv_both", "kv_transfer_timeout": 2.0,
        "kv_connector_extra_config": {"read_timeout_s": 2.0}})
    yield llm
    llm.shutdown()


def test_a_prefix_pulled_from_a_peers_host_tier(
        host_peer: LLM, engines: tuple[LLMEngine, LLMEngine], fast_model_dir: Path) -> None:
    """The peer holds the prefix only in host memory (its pool evicted it): the puller gets
    every full block, served from the host slots without loading them into the peer's pool;
    greedy output equals one engine's and transformers' (fp32); nothing stays pinned."""
    import torch
    from transformers import AutoModelForCausalLM

    peer, puller = host_peer.engine, engines[1]
    tiers, pd = peer.kv_connector.connectors
    prompt = _prompt(43, 6 * BS + 5)
    alone, _, _ = _run(puller, "host-ref", prompt, GREEDY)
    puller.block_manager.reset_prefix_cache()
    host_peer.generate([prompt], PREFILL, use_tqdm=False)
    for k in range(4):  # 4 x 7 blocks through the 24-block pool: the prompt's are evicted
        host_peer.generate([_prompt(3000 + 1000 * k, 6 * BS + 9)], PREFILL, use_tqdm=False)
    chain = peer.hasher().chain(prompt)
    assert peer.block_manager.get_computed_blocks(prompt, chain)[1] == 0  # not in the pool
    ask = {"pull_prefix_from": {"engine_id": "peer", "blocks": 6,
                                "address": f"127.0.0.1:{pd.server.port}"}}
    stop = threading.Event()

    def idle_peer() -> None:  # the server's core loop does this while idle
        while not stop.wait(0.01):
            peer.poll_kv_transfers()

    threading.Thread(target=idle_peer, daemon=True).start()
    try:
        tokens, req, steps = _run(puller, "host-pull", prompt, GREEDY, ask)
        deadline = time.monotonic() + 2
        while pd.peers.held and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
    assert tokens == alone and req.num_cached_tokens == 6 * BS and steps[0] == 5
    assert pd.peers.held == 0 and all(tiers.host._entries[h].pins == 0 for h in chain[:6])
    assert peer.block_manager.get_computed_blocks(prompt, chain)[1] == 0  # never loaded
    assert peer.transfer_stats.snapshot().sent.transfers >= 1
    hf = AutoModelForCausalLM.from_pretrained(str(fast_model_dir), dtype=torch.float32)
    ids = torch.tensor([prompt])
    ref = hf.generate(ids, max_new_tokens=GREEDY.max_tokens, do_sample=False,
                      min_new_tokens=GREEDY.max_tokens)
    assert tokens == ref[0, ids.shape[1]:].tolist()
    puller.block_manager.reset_prefix_cache()


# -- streamed: the decode leg pulls while the prefill's chunks are computed ------------------

STREAM = {"do_remote_decode": True, "kv_stream": True}
CHUNK = 2 * BS  # the streaming prefill engine's step budget: a long prompt takes several steps


def _chunked_prefill(model: Path, num_blocks: int = 160) -> LLM:
    return LLM(str(model), num_blocks=num_blocks, block_size=BS, max_num_seqs=16,
               max_num_batched_tokens=CHUNK, kv_transfer_config={
        "kv_connector": "PagodaPDConnector", "kv_role": "kv_producer", "kv_transfer_timeout": 6.0,
        "kv_connector_extra_config": {"read_timeout_s": 0.5, "max_connections": 3,
                                      "stream_wait_s": 2.0}})


@pytest.fixture(scope="module")
def streamed(fast_model_dir: Path, engines: tuple[LLMEngine, LLMEngine]
             ) -> Iterator[tuple[LLMEngine, LLMEngine]]:
    """A prefill engine whose prompts take several steps, and the decode engine of
    ``engines`` (the internal token is set while ``engines`` lives)."""
    prefill = _chunked_prefill(fast_model_dir)
    yield prefill.engine, engines[1]
    prefill.shutdown()


def _streamed(prefill: LLMEngine, decode: LLMEngine, rid: str, prompt: list[int],
              edit: Any = None, stall_s: float = 0.0, abort_after: int | None = None
              ) -> tuple[list[int], Any, int, dict]:
    """The prefill leg asks to stream; the decode leg starts on its announcement; then both
    engines step in turn (the prefill held back ``stall_s`` first, or aborted after
    ``abort_after`` steps). Returns the decode leg's tokens and request, the prefill steps
    after the announcement, and the announced params."""
    prefill.add_request(rid, prompt, PREFILL, kv_transfer_params=dict(STREAM))
    params = None
    while params is None:
        params = next((u.kv_transfer_params for u in prefill.step()
                       if u.request_id == rid and u.kv_transfer_params), None)
    kv = edit(dict(params)) if edit is not None else dict(params)
    req = decode.add_request(rid, prompt, GREEDY, kv_transfer_params=kv)
    tokens, left = [], 0
    resume, deadline = time.monotonic() + stall_s, time.monotonic() + 30
    while decode.has_unfinished_requests():
        assert time.monotonic() < deadline
        if prefill.has_unfinished_requests() and time.monotonic() >= resume:
            if abort_after is not None and left == abort_after:
                prefill.abort_request(rid)
            prefill.step()
            left += 1
        tokens += [t for u in decode.step() for t in u.new_token_ids]
    while prefill.has_unfinished_requests():
        prefill.step()
    return tokens, req, left, params


def _reference(decode: LLMEngine, rid: str, prompt: list[int]) -> list[int]:
    alone, _, _ = _run(decode, rid, prompt, GREEDY)
    assert decode.block_manager.reset_prefix_cache()
    return alone


@pytest.mark.parametrize("n", [5 * BS + 5, 6 * BS, 2 * BS + 1])
def test_streamed_decode_matches_one_engine_and_overlaps_the_prefill(
        streamed: tuple[LLMEngine, LLMEngine], n: int) -> None:
    """Partial and exact last blocks, several chunks: the params come while the prefill still
    runs, every full block before the last token arrives pulled, the output is one engine's."""
    prefill, decode = streamed
    prompt = _prompt(500 + n, n)
    alone = _reference(decode, f"s-alone{n}", prompt)
    tokens, req, left, params = _streamed(prefill, decode, f"s{n}", prompt)
    assert params["remote_streaming"] is True and params["remote_num_blocks"] == (n - 1) // BS
    assert left >= 1  # announced before the prefill's last step
    assert tokens == alone and req.num_cached_tokens == (n - 1) // BS * BS
    assert _all_free(prefill) and len(prefill.kv_connector.held) == 0
    assert decode.block_manager.reset_prefix_cache()


def test_a_prefill_aborted_mid_stream_costs_a_recompute(
        streamed: tuple[LLMEngine, LLMEngine]) -> None:
    prefill, decode = streamed
    prompt = _prompt(601, 6 * BS + 3)
    alone = _reference(decode, "s-abort-ref", prompt)
    tokens, req, _, _ = _streamed(prefill, decode, "s-abort", prompt, abort_after=1)
    assert tokens == alone and req.num_cached_tokens < 6 * BS  # some arrived, not all
    assert _all_free(prefill) and len(prefill.kv_connector.held) == 0
    assert decode.block_manager.reset_prefix_cache()


def test_a_stalled_prefill_times_out_into_a_recompute(
        streamed: tuple[LLMEngine, LLMEngine]) -> None:
    prefill, decode = streamed
    connector = decode.kv_connector
    prompt = _prompt(611, 6 * BS + 3)
    alone = _reference(decode, "s-stall-ref", prompt)
    before = decode.transfer_stats.snapshot().failures.get("timeout", 0)
    wait, connector.stream_wait_s = connector.stream_wait_s, 0.2
    try:  # the puller waits 0.2 + 0.5 s for a block; the prefill is held back 1.5 s
        tokens, req, _, _ = _streamed(prefill, decode, "s-stall", prompt, stall_s=1.5)
    finally:
        connector.stream_wait_s = wait
    assert tokens == alone and req.num_cached_tokens < 6 * BS
    assert decode.transfer_stats.snapshot().failures.get("timeout", 0) == before + 1
    assert _all_free(prefill, timeout=8.0)
    assert decode.block_manager.reset_prefix_cache()


def test_a_streamed_grant_still_needs_its_signature_and_a_good_checksum(
        streamed: tuple[LLMEngine, LLMEngine]) -> None:
    prefill, decode = streamed
    prompt = _prompt(621, 4 * BS + 3)
    alone = _reference(decode, "s-fault-ref", prompt)
    corrupt = _FaultyServer("corrupt")
    try:
        for rid, edit, reason in (
                ("s-unsigned", lambda p: {**p, "remote_port": corrupt.port}, "unsigned"),
                ("s-corrupt", lambda p: _signed(p, remote_port=corrupt.port), "checksum"),
                ("s-unknown", lambda p: _signed(p, remote_transfer_id="z" * 32), "refused")):
            before = decode.transfer_stats.snapshot().failures.get(reason, 0)
            tokens, req, _, _ = _streamed(prefill, decode, rid, prompt, edit=edit)
            assert tokens == alone and req.num_cached_tokens == 0, rid
            assert decode.transfer_stats.snapshot().failures.get(reason, 0) == before + 1, rid
            assert decode.block_manager.reset_prefix_cache()
    finally:
        corrupt.close()
    assert _all_free(prefill, timeout=8.0)  # never pulled: given up at the expiry
    assert len(prefill.kv_connector.held) == 0


def test_a_prefill_preempted_mid_stream_never_serves_a_reused_block(
        fast_model_dir: Path, engines: tuple[LLMEngine, LLMEngine]) -> None:
    """A small pool: a decoding request holds blocks while the streamed prompt prefills, and
    the prompt runs out of blocks mid-prompt, so the scheduler preempts it (the newest). Its
    stream ends there; the decode engine keeps what arrived, recomputes the rest."""
    decode = engines[1]
    llm = _chunked_prefill(fast_model_dir, num_blocks=11)
    prefill = llm.engine
    try:
        prompt = _prompt(701, 6 * BS + 5)  # 7 blocks; with the other request's 5, 12 > 11
        alone = _reference(decode, "s-preempt-ref", prompt)
        prefill.add_request("other", _prompt(702, 4 * BS), SamplingParams(
            max_tokens=12, temperature=0, ignore_eos=True))
        prefill.step()
        prefill.step()  # its prompt (two chunks) computed; it decodes from here on
        tokens, req, _, _ = _streamed(prefill, decode, "s-preempt", prompt)
        assert tokens == alone and req.num_cached_tokens < 6 * BS
        assert prefill.scheduler.num_preemptions >= 1
        assert _all_free(prefill) and len(prefill.kv_connector.held) == 0
        assert decode.block_manager.reset_prefix_cache()
    finally:
        llm.shutdown()


def test_a_peer_naming_a_streamed_transfer_waits_a_bounded_time(
        streamed: tuple[LLMEngine, LLMEngine]) -> None:
    """An attacker with the credential and the grant (the worst case): one pull at a time, the
    ready blocks, then the server gives up once the prefill stalls past ``stream_wait_s``; the
    transfer is over, so nothing stays held."""
    from services.engine.kv_connector import pd_wire

    prefill, _ = streamed
    prompt = _prompt(631, 6 * BS + 3)
    prefill.add_request("s-port", prompt, PREFILL, kv_transfer_params=dict(STREAM))
    params = None
    while params is None:  # the first step: 2 blocks computed
        params = next((u.kv_transfer_params for u in prefill.step() if u.kv_transfer_params),
                      None)
    ask = {"transfer_id": params["remote_transfer_id"], "first": 0, "count": 6,
           "last_hash": prefill.requests["s-port"].block_hashes[5].hex(),
           "layout": params["kv_layout"]}
    with _connect(prefill) as s, _connect(prefill) as t:
        s.sendall(_frame(json.dumps({**ask, "proof": _hello(s, TOKEN)}).encode()))
        assert _answer(s) == {"ok": True, "count": 6}
        t.sendall(_frame(json.dumps({**ask, "proof": _hello(t, TOKEN)}).encode()))
        assert _answer(t) == {"ok": False, "error": "the transfer is being pulled"}
        started, data = time.monotonic(), b""
        s.settimeout(10)
        while chunk := s.recv(1 << 20):
            data += chunk
        assert time.monotonic() - started < 2.0 + 1.5  # stream_wait_s 2
    assert len(data) == 2 * (4 + 8 + pd_wire.block_bytes(prefill.kv_connector.caches))
    while prefill.has_unfinished_requests():
        prefill.step()
    assert _all_free(prefill) and len(prefill.kv_connector.held) == 0
