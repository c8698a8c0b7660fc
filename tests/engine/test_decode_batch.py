"""A running set that only decodes is scheduled and applied from a ``DecodeBatch``'s arrays
(``Scheduler._schedule_batch``, ``_apply_batch``). Step for step it must leave the scheduler,
the requests and the block pool as the decode path without it does, through stop tokens (more
than the few compared one by one), min_tokens, max_tokens, the context's end, a request that
joins and one that is aborted mid-run, and blocks that run out."""

from __future__ import annotations

import pytest

from services.engine.request import Request, RequestStatus
from tests.engine.test_scheduler import EOS, make_request, make_scheduler

STOPS = [13, 17, 19, 23, 29, 31]  # more than 4 stop ids in the batch: the isin test


def _requests() -> dict[str, Request]:
    reqs = [
        make_request("r0", 3, max_tokens=30, stop_token_ids=STOPS[:5]),
        make_request("r1", 5, max_tokens=30, base=7, stop_token_ids=[31], min_tokens=12),
        make_request("r2", 9, max_tokens=25, base=11),  # aborted mid-run
        make_request("r3", 4, max_tokens=40, base=3),  # EOS at its 12th token
        make_request("r4", 6, max_tokens=7, base=5),  # max_tokens
        make_request("r5", 11, max_tokens=60, base=2),  # the context's end (40)
        make_request("r6", 2, max_tokens=9, base=9),  # joins a batch
    ]
    return {r.request_id: r for r in reqs}


def _token(rid: str, n_out: int) -> int:
    """The token request ``rid`` samples as its output's ``n_out``-th: a fixed walk that hits
    the stop tokens now and then, and EOS once for r3."""
    if rid == "r3" and n_out == 11:
        return EOS
    return 11 + (int(rid[1:]) * 7 + n_out * 5) % 23


def _drive(batches: bool) -> tuple[list, int]:
    sched = make_scheduler(num_blocks=40, max_seqs=8, budget=64, max_model_len=40)
    sched.decode_batches = batches
    reqs = _requests()
    for rid in ("r0", "r1", "r2", "r3", "r4", "r5"):
        sched.add(reqs[rid])
    trace, from_batch, step = [], 0, 0
    while sched.has_unfinished():
        if step == 9:
            sched.abort(reqs["r2"])
            reqs["r2"].status = RequestStatus.FINISHED_ABORTED  # as the engine does
        if step == 12:
            sched.add(reqs["r6"])
        out = sched.schedule()
        from_batch += out.decode_batch is not None
        tokens = [_token(r.request_id, r.num_output_tokens) for r in out.sampling_requests()]
        kept = sched.update(out, tokens)
        trace.append((
            [r.request_id for r in out.requests], list(out.starts),
            [list(b) for b in out.block_ids],
            [r.request_id for r in kept], sched.block_manager.num_free_blocks,
            sched.block_manager.num_cached_blocks,
            [(r.request_id, list(r.token_ids), r.num_computed_tokens, r.status, r.stop_reason,
              r.num_scheduled_tokens, r.num_placeholders, list(r.block_hashes))
             for r in reqs.values()],
        ))
        step += 1
        assert step < 500
    return trace, from_batch


def test_the_batch_leaves_what_the_decode_path_leaves() -> None:
    with_batch, from_batch = _drive(True)
    without, none = _drive(False)
    assert none == 0
    assert from_batch >= 10, from_batch
    assert with_batch == without
    statuses = {r[0]: r[3] for r in with_batch[-1][6]}
    assert statuses["r0"] is RequestStatus.FINISHED_STOPPED  # a stop token
    assert statuses["r2"] is RequestStatus.FINISHED_ABORTED
    assert statuses["r3"] is RequestStatus.FINISHED_STOPPED  # EOS
    assert statuses["r4"] is RequestStatus.FINISHED_LENGTH
    assert statuses["r6"] is RequestStatus.FINISHED_LENGTH


def test_a_second_schedule_before_the_apply_is_refused() -> None:
    """The batch leaves the requests' scheduled counts alone, so it needs each step applied
    before the next is scheduled; async scheduling keeps it off."""
    sched = make_scheduler()
    sched.decode_batches = True
    sched.add(make_request("a", 3, max_tokens=8))
    for _ in range(3):
        out = sched.schedule()
        sched.update(out, [5] * out.num_sampling)
    out = sched.schedule()
    assert out.decode_batch is not None
    with pytest.raises(AssertionError, match="synchronous"):
        sched.schedule()
