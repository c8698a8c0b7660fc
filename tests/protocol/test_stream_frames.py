"""The engine stream's typed frames: what the engine writes the gateway reads back, and bytes
that are not a frame are refused as ``MalformedFrame``, never passed on as half-parsed maps."""

from __future__ import annotations

import msgpack
import pytest

from services.protocol.engine_api import (
    ErrorFrame,
    FinishedFrame,
    FrameDecoder,
    KVTransferFrame,
    MalformedFrame,
    TokenLogprobs,
    TokensFrame,
)


def test_frames_round_trip_across_chunk_boundaries() -> None:
    lp = TokenLogprobs(7, -0.25, 1, [(7, -0.25), (9, -1.5)])
    sent = [
        KVTransferFrame({"do_remote_prefill": True, "remote_streaming": True}),
        TokensFrame([7], [lp], cached_tokens=32),
        TokensFrame([8, 9], [None, lp]),
        TokensFrame([10]),
        FinishedFrame("stop", 2, prompt_tokens=40, completion_tokens=4, cached_tokens=32),
        ErrorFrame("engine step failed"),
    ]
    wire = b"".join(f.to_msgpack() for f in sent)
    dec = FrameDecoder()
    got = [f for i in range(0, len(wire), 5) for f in dec.feed(wire[i : i + 5])]
    assert got == sent


@pytest.mark.parametrize("raw", [
    [1, 2],
    {"type": "nope"},
    {"type": ["tokens"]},
    {"type": "tokens", "token_ids": [1, -2]},
    {"type": "tokens", "token_ids": [1, True]},
    {"type": "tokens", "token_ids": [1], "logprobs": [None, None]},
    {"type": "tokens", "token_ids": [1], "logprobs": [{"token_id": 1}]},
    {"type": "tokens", "token_ids": [1], "cached_tokens": "x"},
    {"type": "finished", "finish_reason": "stop", "stop_reason": None},
    {"type": "finished", "finish_reason": 3, "stop_reason": None, "usage": {}},
    {"type": "finished", "finish_reason": "stop", "stop_reason": None,
     "usage": {"prompt_tokens": 1, "completion_tokens": -1, "cached_tokens": 0}},
    {"type": "kv_transfer"},
    {"type": "kv_transfer", "kv_transfer_params": {"nested": {"a": 1}}},
])
def test_malformed_frames_are_refused(raw: object) -> None:
    with pytest.raises(MalformedFrame):
        FrameDecoder().feed(msgpack.packb(raw))


def test_garbage_bytes_are_refused() -> None:
    with pytest.raises(MalformedFrame):
        FrameDecoder().feed(b"\xc1\xc1\xc1")
