"""The KV connector seam: a connector of this module (registered by name, as a P/D connector
would be) delivers a prefix's KV asynchronously; the request waits for it outside the step,
then runs without recomputing those tokens and with the same output. A finished request whose
blocks the connector holds for sending keeps them until sent or timed out. MultiConnector
tries its parts in order; --kv-transfer-config is checked where it enters."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.kv_connector import registry
from services.engine.kv_connector.base import ConnectorContext, FinishedTransfers
from services.engine.kv_connector.config import KVRole, KVTransferConfig
from services.engine.kv_connector.multi import MultiConnector
from services.protocol.wire import BadRequest

BS = 16
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


class DictConnector:
    """Saves every block the pool caches into a dict (by chain hash) and loads a prefix back
    from it; a load is reported done only once ``deliver`` is set, a held request's blocks
    only once its id is in ``sent``."""

    def __init__(self, spec: KVTransferConfig, ctx: ConnectorContext) -> None:
        self.caches, self.bm = ctx.kv_caches, ctx.block_manager
        self.bm.track_cached = True
        self.store: dict[Any, list[torch.Tensor]] = {}
        self.deliver, self.hold = True, False
        self.sent: set[str] = set()
        self._pending: list[tuple[str, list[Any], list[int]]] = []
        self._arrived: dict[str, int] = {}
        self._asked: tuple[str, int, int] | None = None  # request id, first block, blocks

    def get_num_new_matched_tokens(self, req: Any, num_computed: int) -> tuple[int, bool]:
        first, stop = num_computed // BS, min(len(req.block_hashes), (req.num_tokens - 1) // BS)
        n = 0
        while first + n < stop and req.block_hashes[first + n] in self.store:
            n += 1
        self._asked = (req.request_id, first, n)
        return (n * BS, True) if n else (0, False)

    def update_state_after_alloc(self, req: Any, block_ids: list[int], num_external: int) -> None:
        if num_external:
            rid, first, n = self._asked
            assert rid == req.request_id and n * BS == num_external
            self._pending.append((rid, req.block_hashes[first:first + n],
                                  block_ids[first:first + n]))

    def build_connector_meta(self) -> list[tuple[str, list[Any], list[int]]]:
        loads, self._pending = self._pending, []
        return loads

    def request_finished(self, req: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        return (True, {"remote_block_ids": list(block_ids)}) if self.hold else (False, None)

    def take_announced(self) -> dict:
        return {}

    def start_load_kv(self, loads: list[tuple[str, list[Any], list[int]]]) -> None:
        for rid, hashes, ids in loads:
            for h, block_id in zip(hashes, ids, strict=True):
                for (k, v), saved in zip(self.caches, self.store[h], strict=True):
                    k[block_id].copy_(saved[0])
                    v[block_id].copy_(saved[1])
            self._arrived[rid] = len(hashes) * BS

    def save_kv(self) -> None:
        for block, h, _ in self.bm.take_new_cached():
            self.store[h] = [torch.stack([k[block.block_id], v[block.block_id]]).clone()
                             for k, v in self.caches]

    def get_finished(self, timeout: float = 0.0) -> FinishedTransfers:
        done = FinishedTransfers(sending=self.sent)
        self.sent = set()
        if self.deliver:
            done.recving, self._arrived = self._arrived, {}
        return done

    def take_events(self) -> list:
        return []

    def snapshot_events(self) -> list:
        return []

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def registered() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(registry.CONNECTORS, "DictConnector", f"{__name__}:DictConnector")
        yield


@pytest.fixture(scope="module")
def llm(fast_model_dir: Path, registered: None) -> Iterator[LLM]:
    llm = LLM(str(fast_model_dir), num_blocks=32, block_size=BS, max_num_seqs=4,
              kv_transfer_config={"kv_connector": "DictConnector", "kv_transfer_timeout": 1.0})
    yield llm
    llm.shutdown()


def _prompt(base: int, n: int) -> list[int]:
    return [base + (i * 11) % 700 for i in range(n)]


def test_a_request_waits_for_its_kv_then_runs_without_recomputing_it(llm: LLM) -> None:
    engine, conn = llm.engine, llm.engine.kv_connector
    assert isinstance(conn, DictConnector)
    prompt = _prompt(100, 3 * BS + 5)
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert engine.block_manager.reset_prefix_cache()  # the prefix is only in the connector now
    for k, v in engine.runner.kv_caches:  # and its KV too: a load that copied nothing shows
        k.zero_()
        v.zero_()
    conn.deliver = False
    engine.add_request("r", prompt, GREEDY)
    assert engine.step() == [] and engine.last_step_tokens == 0
    assert "r" in engine.scheduler.loading  # waiting for KV, not in the step
    assert engine.stats().num_waiting == 1
    conn.deliver = True
    tokens = []
    while engine.has_unfinished_requests():
        updates = engine.step()
        if not tokens:  # its first step: the prompt's tail only, the loaded blocks not again
            assert engine.last_step_tokens == 5
        tokens += [t for u in updates for t in u.new_token_ids]
    assert tokens == first.outputs[0].token_ids
    assert updates[-1].num_cached_tokens == 3 * BS


def test_blocks_held_for_sending_are_freed_when_sent_or_after_the_timeout(llm: LLM) -> None:
    engine, conn = llm.engine, llm.engine.kv_connector
    bm = engine.block_manager
    conn.hold = True
    try:
        req = engine.add_request("sent", _prompt(2000, 2 * BS + 3), GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
        assert req.status.is_finished and bm.num_free_blocks < bm.num_total_blocks
        assert req.kv_transfer_params == {"remote_block_ids": bm.block_ids("sent")}
        with pytest.raises(BadRequest, match="already in the engine"):  # its blocks are
            engine.add_request("sent", [1, 2, 3], GREEDY)
        conn.sent.add("sent")
        engine.step()
        assert bm.num_free_blocks == bm.num_total_blocks

        engine.add_request("never", _prompt(3000, 2 * BS + 3), GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
        engine.step()
        assert bm.num_free_blocks < bm.num_total_blocks  # held: not sent, not timed out
        time.sleep(1.0)  # kv_transfer_timeout
        engine.step()
        assert bm.num_free_blocks == bm.num_total_blocks
    finally:
        conn.hold = False


class _Part:
    """A connector that can deliver ``tokens`` for any request and records what it is told."""

    def __init__(self, tokens: int, hold: bool = False) -> None:
        self.tokens, self.hold = tokens, hold
        self.calls: list[tuple] = []
        self.report = FinishedTransfers()
        self.announced: dict[str, dict] = {}

    def get_num_new_matched_tokens(self, req: Any, num_computed: int) -> tuple[int, bool]:
        return (self.tokens, True) if self.tokens else (0, False)

    def update_state_after_alloc(self, req: Any, block_ids: list[int], n: int) -> None:
        self.calls.append(("alloc", req.request_id, n))

    def build_connector_meta(self) -> str:
        return f"meta{self.tokens}"

    def request_finished(self, req: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        return (True, {"from": self.tokens}) if self.hold else (False, None)

    def take_announced(self) -> dict[str, dict]:
        announced, self.announced = self.announced, {}
        return announced

    def start_load_kv(self, metadata: str) -> None:
        self.calls.append(("load", metadata))

    def save_kv(self) -> None:
        self.calls.append(("save",))

    def get_finished(self, timeout: float = 0.0) -> FinishedTransfers:
        report, self.report = self.report, FinishedTransfers()
        return report


class _Req:
    request_id = "q"


def test_multi_connector_loads_from_the_first_that_has_tokens_and_saves_to_all() -> None:
    empty, second, third = _Part(0), _Part(32, hold=True), _Part(48, hold=True)
    multi = MultiConnector([empty, second, third])
    assert multi.get_num_new_matched_tokens(_Req(), 0) == (32, True)  # not the third's 48
    multi.update_state_after_alloc(_Req(), [0, 1, 2], 32)
    assert [p.calls for p in (empty, second, third)] == [
        [("alloc", "q", 0)], [("alloc", "q", 32)], [("alloc", "q", 0)]]
    multi.start_load_kv(multi.build_connector_meta())
    multi.save_kv()
    assert second.calls[1:] == [("load", "meta32"), ("save",)] and empty.calls[-1] == ("save",)
    third.report.recving["q"] = 48  # not the one loading it: ignored
    second.report.recving["q"] = 32
    assert multi.get_finished().recving == {"q": 32}
    # Held by two: freed once both have sent.
    assert multi.request_finished(_Req(), [0, 1]) == (True, {"from": 48})
    second.report.sending.add("q")
    assert multi.get_finished().sending == set()
    third.report.sending.add("q")
    assert multi.get_finished().sending == {"q"}
    second.announced["a"], third.announced["b"] = {"x": 1}, {"y": 2}  # every one's, once
    assert multi.take_announced() == {"a": {"x": 1}, "b": {"y": 2}}
    assert multi.take_announced() == {}


def test_kv_transfer_config_reads_vllm_json_and_names_a_bad_key() -> None:
    from services.engine.config import EngineConfig

    tc = KVTransferConfig.parse('{"kv_connector": "MultiConnector", "kv_role": "kv_consumer",'
                                ' "kv_connector_extra_config": {"connectors": ['
                                '{"kv_connector": "PagodaTiersConnector", "kv_role": '
                                '"kv_producer"}]}}')
    assert tc.kv_role is KVRole.CONSUMER and [leaf.kv_role for leaf in tc.leaves()] == [
        KVRole.PRODUCER]
    bad = {
        '{"kv_connector": "Nope"}': "kv_transfer_config.kv_connector must be one of",
        '{"kv_connector": "PagodaTiersConnector", "kv_role": "both"}':
            "kv_transfer_config.kv_role must be one of kv_producer, kv_consumer, kv_both",
        '{"kv_connector": "PagodaTiersConnector", "kv_ip": "x"}':
            "kv_transfer_config.kv_ip is not a known key",
        '{"kv_connector": "PagodaTiersConnector", "kv_connector_extra_config": 3}':
            "kv_transfer_config.kv_connector_extra_config must be a JSON object",
        '{"kv_connector": "PagodaTiersConnector", "kv_transfer_timeout": 0}':
            "kv_transfer_config.kv_transfer_timeout must be a positive number",
        '{"kv_connector": "MultiConnector"}':
            "kv_transfer_config.kv_connector_extra_config.connectors must be a non-empty list",
        '{"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": '
        '[{"kv_connector": "X"}]}}':
            r"kv_transfer_config.kv_connector_extra_config.connectors\[0\].kv_connector",
        "[1]": "kv_transfer_config must be a JSON object",
        "{": "kv_transfer_config is not valid JSON",
    }
    for text, message in bad.items():
        with pytest.raises(ValueError, match=message):
            KVTransferConfig.parse(text)
    # The tier flags and the named tiers build the same connector.
    tiers = KVTransferConfig("PagodaTiersConnector")
    assert EngineConfig(kv_offloading_size=1).kv_connector_specs() == [tiers]
    named = EngineConfig(kv_transfer_config={"kv_connector": "PagodaTiersConnector",
                                             "kv_connector_extra_config": {
                                                 "kv_offloading_size": 1}})
    assert named.kv_offloading_size == 1
    assert [s.kv_connector for s in named.kv_connector_specs()] == ["PagodaTiersConnector"]
    for extra, message in (({"size": 1}, "kv_connector_extra_config.size is not a key"),
                           ({"kv_store_url": 5}, "kv_store_url must be a string"),
                           ({}, "needs kv_offloading_size or kv_store_url"),
                           ({"kv_offloading_size": -1}, "kv_offloading_size must be")):
        with pytest.raises(ValueError, match=message):
            EngineConfig(kv_transfer_config={"kv_connector": "PagodaTiersConnector",
                                             "kv_connector_extra_config": extra})


def test_the_flag_exits_2_naming_the_key(registered: None,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from services.engine.serving.server_config import configs_from_args

    engine, _ = configs_from_args(["--kv-offloading-size", "1", "--kv-transfer-config",
                                   '{"kv_connector": "DictConnector", "kv_role": "kv_both"}'])
    assert [s.kv_connector for s in engine.kv_connector_specs()] == [
        "PagodaTiersConnector", "DictConnector"]  # the flags' tiers first
    with pytest.raises(SystemExit) as exit_info:
        configs_from_args(["--kv-transfer-config", '{"kv_connector": "DictConnector", '
                           '"kv_role": "producer"}'])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-transfer-config" in err and "kv_transfer_config.kv_role must be one of" in err
