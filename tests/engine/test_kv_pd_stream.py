"""A streamed P/D transfer on the prefill engine's side, without an engine: ``HeldTransfers``
serves a transfer's blocks as the engine thread makes them ready, each pull waits a bounded
time, one pull per transfer, and a transfer cancelled (its prefill preempted or aborted) is
never served again; ``StreamedPrefills`` opens, advances, ends and finishes streams as the
engine thread drives it."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from services.engine.kv_connector import pd_wire
from services.engine.kv_connector.pd_server import HeldTransfers, Runs
from services.engine.kv_connector.pd_stream import NO_TRANSFER, StreamedPrefills, asks_stream
from services.engine.kv_connector.transfer_stats import TransferStats
from services.protocol.block_hash import BlockHash

BS = 4
HASHES = [BlockHash(bytes([i]) * 16) for i in range(6)]


def _caches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two layers of 8 blocks; block b holds the value b everywhere."""
    def layer() -> torch.Tensor:
        return torch.arange(8, dtype=torch.float32).view(8, 1, 1).expand(8, BS, 2).contiguous()
    return [(layer(), layer()) for _ in range(2)]


def _table(expiry_s: float = 30.0, max_held: int = 8) -> HeldTransfers:
    return HeldTransfers(max_held, expiry_s, TransferStats())


def _pull(table: HeldTransfers, tid: str, first: int, count: int, wait_s: float,
          caches: list) -> Runs:
    runs = table.runs(tid, first, count, HASHES[first + count - 1].hex(), caches, wait_s)
    assert isinstance(runs, Runs), runs
    return runs


def test_a_pull_gets_each_run_as_it_becomes_ready() -> None:
    table, caches = _table(), _caches()
    tid = table.open_stream("r", HASHES[:5])
    assert tid is not None
    got: list[list[bytes]] = []
    with _pull(table, tid, 0, 5, 5.0, caches) as runs:
        reader = threading.Thread(target=lambda: got.extend(runs))
        reader.start()
        time.sleep(0.05)
        assert not got  # nothing is ready: it waits
        table.advance(tid, [3, 1])
        table.advance(tid, [3, 1, 4, 6])
        table.advance(tid, [3, 1, 4, 6, 2])
        reader.join(5)
    blocks = [b for run in got for b in run]
    assert blocks == [pd_wire.read_block(caches, b) for b in (3, 1, 4, 6, 2)]
    assert table.finish(tid, [3, 1, 4, 6, 2]) is False  # pulled: nothing to hold
    assert len(table) == 0


def test_a_stalled_prefill_ends_the_pull_after_its_wait_and_the_transfer_with_it() -> None:
    table, caches = _table(), _caches()
    tid = table.open_stream("r", HASHES[:3])
    table.advance(tid, [5])
    started = time.monotonic()
    with _pull(table, tid, 0, 3, 0.2, caches) as runs, pytest.raises(pd_wire.TooSlow):
        for _ in runs:
            pass
    assert time.monotonic() - started < 2.0
    # One pull per transfer: a peer naming it again gets nothing, and nothing waits.
    assert table.runs(tid, 1, 2, HASHES[2].hex(), caches, 5.0) == "unknown transfer id"
    assert table.finish(tid, [5, 6, 7]) is False


def test_a_pull_never_waits_past_the_transfers_expiry() -> None:
    table, caches = _table(expiry_s=0.3), _caches()
    tid = table.open_stream("r", HASHES[:2])
    started = time.monotonic()
    with _pull(table, tid, 0, 2, 60.0, caches) as runs, pytest.raises(pd_wire.TooSlow):
        next(runs)
    assert time.monotonic() - started < 2.0
    assert table.take_done() == {"r"} and len(table) == 0  # expired: given up


def test_cancel_wakes_a_waiting_pull_and_nothing_is_served_after() -> None:
    table, caches = _table(), _caches()
    tid = table.open_stream("r", HASHES[:4])
    table.advance(tid, [1, 2])
    errors: list[Exception] = []
    with _pull(table, tid, 0, 4, 30.0, caches) as runs:
        first = next(runs)
        assert len(first) == 2

        def rest() -> None:
            try:
                next(runs)
            except pd_wire.WireError as exc:
                errors.append(exc)

        reader = threading.Thread(target=rest)
        reader.start()
        time.sleep(0.05)
        table.cancel(tid)  # preempted: blocks 1, 2 may be reused once this returns
        reader.join(5)
    assert len(errors) == 1 and isinstance(errors[0], pd_wire.Refused)
    assert table.runs(tid, 0, 4, HASHES[3].hex(), caches, 1.0) == "unknown transfer id"


def test_one_pull_at_a_time_and_only_the_same_prompt() -> None:
    table, caches = _table(), _caches()
    tid = table.open_stream("r", HASHES[:3])
    assert table.runs(tid, 0, 3, HASHES[1].hex(), caches, 1.0) == "another prompt's blocks"
    assert table.runs(tid, 0, 4, HASHES[3].hex(), caches, 1.0) == \
        "blocks out of the transfer's range"
    with _pull(table, tid, 0, 3, 1.0, caches):
        assert table.runs(tid, 0, 3, HASHES[2].hex(), caches, 1.0) == \
            "the transfer is being pulled"


def test_streams_count_against_the_held_cap() -> None:
    table = _table(max_held=2)
    assert table.open_stream("a", HASHES[:2]) and table.add("b", [1], HASHES[:1])
    assert table.open_stream("c", HASHES[:2]) is None


def test_a_finished_stream_is_held_until_pulled() -> None:
    table, caches = _table(), _caches()
    tid = table.open_stream("r", HASHES[:2])
    table.advance(tid, [7])
    assert table.finish(tid, [7, 0]) is True
    assert table.take_done() == set()
    with _pull(table, tid, 0, 2, 1.0, caches) as runs:
        assert [b for run in runs for b in run] == [pd_wire.read_block(caches, b)
                                                    for b in (7, 0)]
    assert table.take_done() == {"r"} and len(table) == 0


# -- StreamedPrefills: the engine thread's side ------------------------------------------------


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    block_hashes: list[BlockHash]
    kv_transfer_params: dict = field(default_factory=lambda: {"do_remote_decode": True,
                                                              "kv_stream": True})
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0


class _Blocks:
    def __init__(self) -> None:
        self.ids: dict[str, list[int]] = {}

    def block_ids(self, rid: str) -> list[int]:
        return self.ids[rid]


def _grant(rid: str, tid: str, n: int) -> dict:
    return {"do_remote_prefill": True, "remote_transfer_id": tid, "remote_num_blocks": n}


def _streams() -> tuple[StreamedPrefills, HeldTransfers, _Blocks]:
    table, blocks = _table(), _Blocks()
    return StreamedPrefills(table, BS, blocks), table, blocks


def test_asks_stream_only_with_both_keys() -> None:
    assert asks_stream({"do_remote_decode": True, "kv_stream": True})
    assert not asks_stream({"do_remote_decode": True})
    assert not asks_stream({"kv_stream": True}) and not asks_stream(None)


def test_a_stream_is_announced_advanced_and_finished() -> None:
    streams, table, blocks = _streams()
    req = _Request("r", list(range(4 * BS)), HASHES[:4])  # exact last block: 3 to stream
    blocks.ids["r"] = [5, 6]
    streams.open(req, _grant)
    announced = streams.take_announced()
    assert announced["r"]["remote_num_blocks"] == 3 and announced["r"]["remote_streaming"]
    streams.open(req, _grant)  # admitted again (after a preemption): no second stream
    assert streams.take_announced() == {} and len(table) == 1
    req.num_computed_tokens = 2 * BS
    streams.advance()
    tid = announced["r"]["remote_transfer_id"]
    runs = table.runs(tid, 0, 3, HASHES[2].hex(), _caches(), 1.0)
    assert isinstance(runs, Runs) and len(next(runs)) == 2
    blocks.ids["r"] = [5, 6, 7, 1]
    req.num_computed_tokens = 4 * BS
    assert streams.finish(req, blocks.ids["r"]) == (True, announced["r"])
    assert len(next(runs)) == 1
    runs.close()
    assert table.take_done() == {"r"}


def test_a_preempted_stream_ends_before_its_blocks_can_be_reused() -> None:
    streams, table, blocks = _streams()
    req = _Request("r", list(range(3 * BS + 1)), HASHES[:4])
    blocks.ids["r"] = [2, 3, 4, 5]
    streams.open(req, _grant)
    tid = streams.take_announced()["r"]["remote_transfer_id"]
    req.num_computed_tokens = BS
    streams.advance()
    req.num_preemptions, req.num_computed_tokens = 1, 0  # the scheduler preempted it
    streams.ended()
    assert len(table) == 0
    assert table.runs(tid, 0, 3, HASHES[2].hex(), _caches(), 1.0) == "unknown transfer id"
    req.num_computed_tokens = len(req.prompt_token_ids)
    assert streams.finish(req, [2, 3, 4, 5]) == (False, NO_TRANSFER)


def test_an_abort_mid_prompt_cancels_and_frees() -> None:
    streams, table, blocks = _streams()
    req = _Request("r", list(range(3 * BS + 1)), HASHES[:4])
    blocks.ids["r"] = [2, 3]
    streams.open(req, _grant)
    req.num_computed_tokens = 2 * BS
    streams.advance()
    assert streams.finish(req, [2, 3]) == (False, NO_TRANSFER) and len(table) == 0


def test_a_prompt_within_one_block_is_not_streamed() -> None:
    streams, table, _ = _streams()
    streams.open(_Request("r", list(range(BS)), HASHES[:1]), _grant)
    assert streams.take_announced() == {} and len(table) == 0
