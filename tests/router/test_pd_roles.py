"""Disaggregated serving: engines carry their P/D role in the heartbeat, and a route request
for a prefill or decode leg goes only to engines of that role (or of both); a request without
a role goes anywhere. A role outside the three is refused."""

from __future__ import annotations

import dataclasses

import pytest

from services.common.redis_index import KVIndexPublisher
from services.protocol.messages import EngineHeartbeat, RouteRequest, RouteResponse
from services.protocol.wire import BadRequest
from services.router.server import MSGPACK
from tests.router.util import BLOCK_SIZE, MODEL, chain, heartbeat, router_client


@pytest.mark.asyncio
async def test_a_leg_goes_to_an_engine_of_its_role(redis_url: str,
                                                   publisher: KVIndexPublisher) -> None:
    for engine_id, role in (("p", "prefill"), ("d", "decode")):
        await publisher.publish_heartbeat(dataclasses.replace(heartbeat(engine_id),
                                                              kv_role=role))
    prompt = chain(3)
    async with router_client(redis_url=redis_url, policy="round-robin") as client:
        async def chosen(role: str | None) -> str:
            req = RouteRequest(MODEL, prompt, len(prompt) * BLOCK_SIZE + 1, role=role)
            resp = await client.post("/route", data=req.to_msgpack(),
                                     headers={"Content-Type": MSGPACK})
            assert resp.status == 200, await resp.text()
            return RouteResponse.from_msgpack(await resp.read()).engine_id

        assert {await chosen("prefill") for _ in range(4)} == {"p"}
        assert {await chosen("decode") for _ in range(4)} == {"d"}
        assert {await chosen(None) for _ in range(4)} == {"p", "d"}
        await publisher.publish_heartbeat(heartbeat("b"))  # "both" serves either leg
        assert {await chosen("decode") for _ in range(6)} == {"d", "b"}


def test_roles_are_checked_where_they_enter() -> None:
    raw = heartbeat("x").to_dict()
    with pytest.raises(BadRequest, match="kv_role must be one of prefill, decode, both"):
        EngineHeartbeat.from_dict({**raw, "kv_role": "leader"})
    assert EngineHeartbeat.from_dict(raw).kv_role == "both"  # an older engine's heartbeat
    with pytest.raises(BadRequest, match="role must be prefill or decode"):
        RouteRequest.from_dict({"model": MODEL, "block_hashes": [], "prompt_len": 1,
                                "role": "both"})
