"""Two-phase P/D routing and the peer tier, against a real Redis.

The prefill leg goes by prefix, the decode leg by load and free KV; engines pair only when
their KV layouts (the heartbeat's ``kv_layout``) are equal, so a rollout never pairs an old
prefill engine with a new decode engine. An engine that holds fewer of a prompt's blocks than
a peer of its layout with a transfer address is told where to pull them (``kv_peer``), and the
prefix policy counts those blocks as a tier between its own and recomputing."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest
from aiohttp.test_utils import TestClient

from services.common.redis_index import KVIndexPublisher
from services.protocol.block_hash import AdapterKey, BlockHash, BlockHasher
from services.protocol.kv_events import Medium
from services.protocol.lora_api import IN_SLOT, AdapterStatus
from services.protocol.messages import EngineHeartbeat, KVPeer, RouteRequest, RouteResponse
from services.protocol.wire import BadRequest
from services.router.policies import Candidate, decode_choice, tiered_match
from services.router.server import MSGPACK
from tests.router.util import BLOCK_SIZE, MODEL, chain, heartbeat, router_client, stored

OLD, NEW = "layout-old", "layout-new"


def engine(engine_id: str, role: str = "both", *, layout: str | None = OLD,
           address: str | None = None, **load: Any) -> EngineHeartbeat:
    hb = heartbeat(engine_id, **{k: v for k, v in load.items() if k != "free_blocks"})
    free = load.get("free_blocks", round(hb.total_blocks * (1 - hb.kv_usage)))
    return dataclasses.replace(hb, kv_role=role, kv_layout=layout, kv_transfer_address=address,
                               free_blocks=free)


async def ask(client: TestClient, prompt: list[BlockHash], role: str | None = None, *,
              layout: str | None = None, lora: str | None = None,
              exclude: list[str] | None = None) -> RouteResponse:
    req = RouteRequest(MODEL, prompt, len(prompt) * BLOCK_SIZE + 1, exclude or [], role=role,
                       kv_layout=layout, lora_name=lora)
    resp = await client.post("/route", data=req.to_msgpack(), headers={"Content-Type": MSGPACK})
    assert resp.status == 200, await resp.text()
    return RouteResponse.from_msgpack(await resp.read())


@pytest.mark.asyncio
async def test_the_prefill_leg_goes_by_prefix_the_decode_leg_by_load_and_free_kv(
        redis_url: str, publisher: KVIndexPublisher) -> None:
    prompt = chain(8)
    await publisher.publish_heartbeat(engine("p1", "prefill", running=3))
    await publisher.publish_heartbeat(engine("p2", "prefill"))
    await publisher.apply_events("p1", MODEL, [stored(prompt)])
    # d-full: idle but its KV nearly full; d-busy: two requests running, KV mostly free.
    await publisher.publish_heartbeat(engine("d-full", "decode", kv_usage=0.95))
    await publisher.publish_heartbeat(engine("d-busy", "decode", running=2, kv_usage=0.1))
    await publisher.apply_events("d-full", MODEL, [stored(prompt)])  # no prefix counts
    async with router_client(redis_url=redis_url) as client:
        first = await ask(client, prompt, "prefill")
        assert (first.engine_id, first.reason) == ("p1", "prefix-hit")
        second = await ask(client, prompt, "decode", layout=OLD)
        assert (second.engine_id, second.reason, second.kv_peer) == ("d-busy", "decode-load",
                                                                     None)
        # An engine without free blocks for the prompt loses even to a much busier one.
        await publisher.publish_heartbeat(engine("d-full", "decode", kv_usage=0.5,
                                                 free_blocks=3))
        await publisher.publish_heartbeat(engine("d-busy", "decode", running=9, kv_usage=0.1))
        assert (await ask(client, prompt, "decode", layout=OLD)).engine_id == "d-busy"
        # The prefill engines' autoscaling signal: prompt tokens per leg.
        text = await (await client.get("/metrics")).text()
        tokens = len(prompt) * BLOCK_SIZE + 1
        assert f'pagoda_router_prompt_tokens_total{{model="{MODEL}",role="prefill"}} ' \
            f'{float(tokens)}' in text
        assert f'pagoda_router_prompt_tokens_total{{model="{MODEL}",role="decode"}} ' \
            f'{float(2 * tokens)}' in text


def test_decode_choice_weighs_load_against_kv_usage() -> None:
    def cand(engine_id: str, running: int, kv: float, free: int = 500) -> Candidate:
        return Candidate(engine_id, "u", 0, running, 0, 0, kv, free_blocks=free,
                         total_blocks=1000)

    assert decode_choice([cand("full", 2, 0.9), cand("empty", 3, 0.1)], 8).candidate.engine_id \
        == "empty"
    assert decode_choice([cand("half", 0, 0.5), cand("busy", 8, 0.0)], 8).candidate.engine_id \
        == "half"
    assert decode_choice([cand("short", 0, 0.0, free=4), cand("busy", 8, 0.9)], 8) \
        .candidate.engine_id == "busy"


@pytest.mark.asyncio
async def test_a_rollout_never_pairs_an_old_prefill_engine_with_a_new_decode_engine(
        redis_url: str, publisher: KVIndexPublisher) -> None:
    prompt = chain(6, start=1)
    await publisher.publish_heartbeat(engine("p-old", "prefill", layout=OLD, running=2))
    await publisher.publish_heartbeat(engine("p-new", "prefill", layout=NEW))
    await publisher.publish_heartbeat(engine("d-old", "decode", layout=OLD, running=4))
    await publisher.apply_events("p-new", MODEL, [stored(prompt)])
    async with router_client(redis_url=redis_url) as client:
        # No decode engine has the new layout yet: the new prefill engine waits, prefix or not.
        assert (await ask(client, prompt, "prefill")).engine_id == "p-old"
        await publisher.publish_heartbeat(engine("d-new", "decode", layout=NEW, running=9))
        assert (await ask(client, prompt, "prefill")).engine_id == "p-new"
        # Each decode leg goes to its prefill engine's layout, however busy that engine is.
        assert (await ask(client, prompt, "decode", layout=NEW)).engine_id == "d-new"
        assert (await ask(client, prompt, "decode", layout=OLD)).engine_id == "d-old"
        # No decode engine of that layout: served anyway (it computes the prompt), said so.
        lost = await ask(client, prompt, "decode", layout="layout-gone")
        assert (lost.engine_id, lost.reason) == ("d-old", "unpaired")
        # A decode leg without a layout (the prefill leg failed) goes by load alone.
        assert (await ask(client, prompt, "decode")).engine_id == "d-old"


@pytest.mark.asyncio
async def test_a_less_loaded_engine_wins_with_the_prefix_pulled_from_its_peer(
        redis_url: str, publisher: KVIndexPublisher) -> None:
    prompt = chain(10, start=2)
    await publisher.publish_heartbeat(engine("a", address="10.0.0.1:7100", running=4))
    await publisher.publish_heartbeat(engine("b", address="10.0.0.2:7100"))
    await publisher.apply_events("a", MODEL, [stored(prompt)])
    async with router_client(redis_url=redis_url) as client:
        resp = await ask(client, prompt)
        assert (resp.engine_id, resp.reason) == ("b", "peer-prefix")
        assert resp.kv_peer == KVPeer("a", "10.0.0.1:7100", 10)
        # b now holds the prompt (the router's write-back): nothing more to pull from a.
        again = await ask(client, prompt)
        assert again.kv_peer is None
        # A peer that failed a request lends nothing.
        other = chain(10, start=3)
        await publisher.apply_events("a", MODEL, [stored(other)])
        resp = await ask(client, other, exclude=["a"])
        assert (resp.engine_id, resp.kv_peer) == ("b", None)
        # A decode leg that pulls a prefill engine's blocks never pulls a peer's.
        await publisher.publish_heartbeat(engine("b", "decode", address="10.0.0.2:7100"))
        assert (await ask(client, chain(10, start=4), "decode", layout=OLD)).kv_peer is None


@pytest.mark.asyncio
async def test_a_peer_lends_what_it_holds_only_in_its_host_tier(
        redis_url: str, publisher: KVIndexPublisher) -> None:
    """The lender's pool evicted the prefix, its host tier keeps it (medium CPU): it still
    lends all of it, as the engine serves a pull from the host tier."""
    prompt = chain(10, start=7)
    await publisher.publish_heartbeat(engine("a", address="10.0.0.1:7100", running=4))
    await publisher.publish_heartbeat(engine("b", address="10.0.0.2:7100"))
    await publisher.apply_events("a", MODEL, [
        dataclasses.replace(stored(prompt), medium=Medium.CPU)])
    async with router_client(redis_url=redis_url) as client:
        resp = await ask(client, prompt)
        assert (resp.engine_id, resp.reason) == ("b", "peer-prefix")
        assert resp.kv_peer == KVPeer("a", "10.0.0.1:7100", 10)


@pytest.mark.asyncio
async def test_a_decode_leg_that_computes_its_prompt_goes_by_prefix_with_peers(
        redis_url: str, publisher: KVIndexPublisher) -> None:
    """No prefill leg (no layout named): the decode engine computes the prompt, so the one
    holding its prefix wins over a less loaded one, and a peer's blocks are lent; with a
    prefill's layout the leg still goes by load and free KV alone."""
    prompt, other = chain(8, start=8), chain(8, start=9)
    await publisher.publish_heartbeat(engine("d-warm", "decode", running=2))  # lends nothing
    await publisher.publish_heartbeat(engine("d-idle", "decode", address="10.0.0.4:7100"))
    await publisher.publish_heartbeat(engine("p", "prefill", address="10.0.0.5:7100",
                                             running=5))
    await publisher.apply_events("d-warm", MODEL, [stored(prompt)])
    await publisher.apply_events("p", MODEL, [stored(other)])
    async with router_client(redis_url=redis_url) as client:
        direct = await ask(client, prompt, "decode")
        assert (direct.engine_id, direct.reason, direct.matched_blocks) == ("d-warm",
                                                                            "prefix-hit", 8)
        assert direct.kv_layout == OLD  # the gateway keeps it for a prefill of that layout
        pulled = await ask(client, prompt, "decode", layout=OLD)
        assert (pulled.engine_id, pulled.reason) == ("d-idle", "decode-load")
        lent = await ask(client, other, "decode")  # the prefill engine holds it: lent
        assert (lent.engine_id, lent.kv_peer) == ("d-idle", KVPeer("p", "10.0.0.5:7100", 8))


@pytest.mark.asyncio
async def test_no_peer_without_a_transfer_address_or_with_another_layout(
        redis_url: str, publisher: KVIndexPublisher) -> None:
    first, second = chain(10, start=5), chain(10, start=6)
    await publisher.publish_heartbeat(engine("a", running=4))  # no transfer server
    await publisher.publish_heartbeat(engine("n", layout=NEW, address="10.0.0.9:7100",
                                             running=4))
    await publisher.publish_heartbeat(engine("b", address="10.0.0.2:7100"))
    await publisher.apply_events("a", MODEL, [stored(first)])
    await publisher.apply_events("n", MODEL, [stored(second)])
    async with router_client(redis_url=redis_url) as client:
        # b is idle, but a cannot lend (no address) and n's blocks are of another layout:
        # the busy engines that hold the prefixes keep them.
        resp = await ask(client, first)
        assert (resp.engine_id, resp.kv_peer) == ("a", None)
        resp = await ask(client, second)
        assert (resp.engine_id, resp.kv_peer) == ("n", None)


@pytest.mark.asyncio
async def test_an_engine_holding_the_adapter_pulls_the_prefix_from_one_that_does_not(
        redis_url: str, publisher: KVIndexPublisher) -> None:
    tokens = list(range(6 * BLOCK_SIZE))
    prompt = BlockHasher(MODEL, BLOCK_SIZE, None, adapter=AdapterKey("sql", "v1")).chain(tokens)
    await publisher.publish_heartbeat(engine("a", address="10.0.0.1:7100"))  # adapter unloaded
    await publisher.publish_heartbeat(dataclasses.replace(
        engine("b", address="10.0.0.2:7100", running=3),
        adapters=[AdapterStatus("sql", "v1", IN_SLOT)]))
    await publisher.apply_events("a", MODEL, [stored(prompt)])
    async with router_client(redis_url=redis_url) as client:
        resp = await ask(client, prompt, lora="sql")
        assert (resp.engine_id, resp.kv_peer) == ("b", KVPeer("a", "10.0.0.1:7100", 6))


def test_tiered_match_puts_a_peer_between_host_memory_and_the_shared_store() -> None:
    def cand(pool: int, reach: int, peer: int, shared: int) -> Candidate:
        return Candidate("e", "u", pool, 0, 0, 0, 0.0, reach_blocks=reach, shared_blocks=shared,
                         peer_blocks=peer)

    assert tiered_match(cand(0, 0, 10, 0)) == pytest.approx(6.0)
    assert tiered_match(cand(2, 4, 8, 10)) == pytest.approx(2 + 0.8 * 2 + 0.6 * 4 + 0.5 * 2)
    assert tiered_match(cand(0, 0, 4, 10)) == pytest.approx(0.6 * 4 + 0.5 * 6)
    assert tiered_match(cand(5, 5, 3, 0)) == 5.0  # a shorter peer adds nothing


@pytest.mark.parametrize("address", [
    "10.0.0.1", "10.0.0.1:0", "10.0.0.1:70000", "http://10.0.0.1:7100", "host:71/x",
    "evil host:7100", "[::1:7100", "a:7100\n",
])
def test_a_bad_transfer_address_is_refused_where_it_enters(address: str) -> None:
    raw = engine("x").to_dict()
    with pytest.raises(BadRequest, match="kv_transfer_address must be host:port") as err:
        EngineHeartbeat.from_dict({**raw, "kv_transfer_address": address})
    assert err.value.param == "kv_transfer_address"
    with pytest.raises(BadRequest, match="KVPeer.address must be host:port"):
        KVPeer.from_dict({"engine_id": "a", "address": address, "blocks": 1})


def test_good_addresses_and_layouts_pass_and_old_heartbeats_have_none() -> None:
    raw = engine("x").to_dict()
    for address in ("10.0.0.1:7100", "pagoda-engine-0.pagoda.svc:7100", "[fd00::1]:7100"):
        hb = EngineHeartbeat.from_dict({**raw, "kv_transfer_address": address})
        assert hb.kv_transfer_address == address
    old = {k: v for k, v in raw.items() if k not in ("kv_layout", "kv_transfer_address")}
    hb = EngineHeartbeat.from_dict(old)
    assert (hb.kv_layout, hb.kv_transfer_address) == (None, None)
    with pytest.raises(BadRequest, match="kv_layout must be letters") as err:
        EngineHeartbeat.from_dict({**raw, "kv_layout": "a b"})
    assert err.value.param == "kv_layout"
    with pytest.raises(BadRequest, match="at most 128"):
        EngineHeartbeat.from_dict({**raw, "kv_layout": "a" * 129})


@pytest.mark.asyncio
async def test_a_bad_layout_on_route_is_a_400_naming_the_field(
        redis_url: str, publisher: KVIndexPublisher) -> None:
    await publisher.publish_heartbeat(engine("d", "decode"))
    body = RouteRequest(MODEL, [], 1, role="decode", kv_layout="x").to_dict()
    async with router_client(redis_url=redis_url) as client:
        for bad in ("../../etc", "", 7, "x" * 200):
            resp = await client.post("/route", data=_packed({**body, "kv_layout": bad}),
                                     headers={"Content-Type": MSGPACK})
            assert resp.status == 400, bad
            assert (await resp.json())["error"]["param"] == "kv_layout"


def test_a_route_response_never_names_a_peer_that_holds_no_more_than_the_engine() -> None:
    raw = RouteResponse("b", "http://b:8000", 3, "prefix-hit", "prefix").to_dict()
    with pytest.raises(BadRequest, match="kv_peer must hold more blocks"):
        RouteResponse.from_dict({**raw, "kv_peer": {"engine_id": "a", "address": "a:1",
                                                    "blocks": 3}})
    resp = RouteResponse.from_dict({**raw, "kv_peer": {"engine_id": "a", "address": "a:1",
                                                       "blocks": 4}})
    assert RouteResponse.from_msgpack(resp.to_msgpack()) == resp


def _packed(body: dict[str, Any]) -> bytes:
    return msgpack.packb(body, use_bin_type=True)
