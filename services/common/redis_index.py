"""The Redis block index's client: engines publish heartbeats and KV events, routers look
prompts up and write their choices back. The layout (keys, types, expiries, why one sorted set
per engine) is the contract in ``services.protocol.redis_schema``; this module holds the Lua
scripts that read and write it, and the connection set-up (timeouts, credentials, TLS).

Lookup (``KVIndexReader.lookup``) is one EVALSHA, whatever the prompt length: the script reads
every live engine's heartbeat and pending count (two MGETs), asks each engine's sorted set for
the prompt's first and last block (one ZMSCORE: settles engines holding none or all of it), and
searches the rest 4-ary (about log4(blocks) more ZMSCOREs of 3 members). Hashes travel as one
concatenated argument and the reply is one msgpack string, so a long prompt costs the client
almost nothing. The script only reads. Requires Redis >= 6.2 (ZMSCORE, ZADD GT). Times are Redis
server time (``TIME`` inside the scripts), so engine and router clocks never need to agree.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

import msgpack
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError

from services.protocol.kv_events import KVEvent, KVEventKind, Medium, encode_batch
from services.protocol.messages import EngineHeartbeat
from services.protocol.redis_schema import (
    DEFAULT_BLOCK_TTL_S,
    DEFAULT_HEARTBEAT_TTL_S,
    DEFAULT_MAX_BLOCKS_PER_ENGINE,
    DEFAULT_PENDING_TTL_S,
    DEFAULT_PROVISIONAL_TTL_S,
    REGISTRY_TTL_S,
    RedisKeys,
)
from services.protocol.wire import BLOCK_HASH_BYTES

# Hashes per script call when applying events: keeps any one script run short (Redis is
# single-threaded); several calls share one pipeline round trip.
_EVENT_CHUNK = 2048

# ---------------------------------------------------------------------------------------------
# Lua scripts. Shared helper: ``now_ms()`` from the server clock; ``trim()`` drops expired
# entries and caps the set. Scores are absolute expiry times in Redis milliseconds.

_LUA_PRELUDE = """
local HASH = 16  -- block hashes travel concatenated in one argument: far cheaper than one each
local function hash_at(blob, i)
  return string.sub(blob, (i - 1) * HASH + 1, i * HASH)
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function trim(key, now, cap)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  local extra = redis.call('ZCARD', key) - cap
  if extra > 0 then redis.call('ZREMRANGEBYRANK', key, 0, extra - 1) end
end
local function extend_ttl(key, ttl)
  local pttl = redis.call('PTTL', key)
  if pttl == -1 or (pttl >= 0 and pttl < ttl) then redis.call('PEXPIRE', key, ttl) end
end
-- ZADD (flag may be nil) or ZREM of every hash in blob, 500 members per call.
local function each_hash(cmd, key, flag, score, blob)
  local n = math.floor(#blob / HASH)
  local args = {}
  for j = 1, n do
    if score then args[#args + 1] = score end
    args[#args + 1] = hash_at(blob, j)
    if #args >= 1000 or j == n then
      if flag then
        redis.call(cmd, key, flag, unpack(args))
      else
        redis.call(cmd, key, unpack(args))
      end
      args = {}
    end
  end
  return n
end
"""

# KEYS[1] = engine's block set. ARGV = ttl_ms, cap, then ops: kind ('S'|'R'|'C'), hashes blob.
_APPLY_EVENTS_LUA = (
    _LUA_PRELUDE
    + """
local key = KEYS[1]
local ttl = tonumber(ARGV[1])
local cap = tonumber(ARGV[2])
local now = now_ms()
local stored = false
for i = 3, #ARGV - 1, 2 do
  local kind = ARGV[i]
  if kind == 'S' then
    stored = each_hash('ZADD', key, nil, now + ttl, ARGV[i + 1]) > 0 or stored
  elseif kind == 'R' then
    each_hash('ZREM', key, nil, nil, ARGV[i + 1])
  elseif kind == 'C' then
    redis.call('DEL', key)
  end
end
if redis.call('EXISTS', key) == 1 then
  trim(key, now, cap)
  if stored then redis.call('PEXPIRE', key, ttl) end
end
return redis.call('ZCARD', key)
"""
)

# KEYS[1] = engines set. ARGV[1] = "ns:{model}:" prefix, ARGV[2] = the prompt's hashes blob.
# Returns msgpack of [now_ms, [dead ids...], shared, id1, hb1, pending1, matched1, reach1, id2,
# ...]: matched = leading blocks in the engine's pool, reach = leading blocks in its pool or
# host tier (>= matched), shared = leading blocks in the model's shared store.
# leading() finds how many leading blocks an engine holds, relying on prefix-closed caches: a
# first ZMSCORE of blocks 1 and n settles engines that hold none or all of the prompt (most of
# them); the rest get a 4-ary search, 3 ZMSCORE members per step (about log4(n) steps). The
# probe plans depend only on (lo, hi), so engines share them.
_LOOKUP_LUA = (
    _LUA_PRELUDE
    + """
local prefix = ARGV[1]
local blob = ARGV[2]
local n = math.floor(#blob / HASH)
local K = 3
local now = now_ms()
local out = {now, {}}
local dead = out[2]
local plans = {}
local function plan(lo, hi)
  local k = lo * 1048576 + hi
  local cached = plans[k]
  if cached then return cached end
  local probes = {}
  if lo == 0 and hi == n + 1 then
    probes[1] = 1
    if n > 1 then probes[2] = n end
  else
    for j = 1, K do
      local p = lo + math.floor(j * (hi - lo) / (K + 1))
      if p > lo and p < hi and (#probes == 0 or p > probes[#probes]) then
        probes[#probes + 1] = p
      end
    end
  end
  local members = {}
  for i, p in ipairs(probes) do members[i] = hash_at(blob, p) end
  cached = {probes, members}
  plans[k] = cached
  return cached
end
-- leading(key, lo, other): blocks 1..lo are known held; a block counts when it is in key,
-- or (given) in other: the longest prefix reachable through either tier.
local function leading(key, lo, other)
  local hi = n + 1  -- invariant: blocks 1..lo held, block hi not (n + 1: past the end)
  while hi - lo > 1 do
    local step = plan(lo, hi)
    local scores = redis.call('ZMSCORE', key, unpack(step[2]))
    local extra = other and redis.call('ZMSCORE', other, unpack(step[2]))
    for i, p in ipairs(step[1]) do
      local s = scores[i]
      local held = s and tonumber(s) > now
      if not held and extra then
        local e = extra[i]
        held = e and tonumber(e) > now
      end
      if held then lo = p else hi = p; break end
    end
  end
  return lo
end
local ids = redis.call('SMEMBERS', KEYS[1])
local hbs, pends = {}, {}
for first = 1, #ids, 500 do
  local hk, pk = {}, {}
  for i = first, math.min(#ids, first + 499) do
    hk[#hk + 1] = prefix .. 'hb:' .. ids[i]
    pk[#pk + 1] = prefix .. 'pend:' .. ids[i]
  end
  local h = redis.call('MGET', unpack(hk))
  local p = redis.call('MGET', unpack(pk))
  for i = 1, #hk do
    hbs[first + i - 1] = h[i]
    pends[first + i - 1] = p[i]
  end
end
local shared = prefix .. 'sblk'
out[3] = (n > 0 and redis.call('EXISTS', shared) == 1) and leading(shared, 0, nil) or 0
for i, id in ipairs(ids) do
  if hbs[i] then
    out[#out + 1] = id
    out[#out + 1] = hbs[i]
    out[#out + 1] = tonumber(pends[i] or '0')
    local pool = leading(prefix .. 'blk:' .. id, 0, nil)
    out[#out + 1] = pool
    local host = prefix .. 'hblk:' .. id
    if pool < n and redis.call('EXISTS', host) == 1 then
      out[#out + 1] = leading(prefix .. 'blk:' .. id, pool, host)
    else
      out[#out + 1] = pool
    end
  else
    dead[#dead + 1] = id
  end
end
-- One msgpack string instead of a multi-bulk reply: far cheaper for the client to parse.
return cmsgpack.pack(out)
"""
)

# KEYS[1] = chosen engine's block set, KEYS[2] = its pending counter, KEYS[3] = engines set.
# ARGV = ttl_ms, cap, pending_ttl_ms, hashes blob, dead engine ids...
# ZADD GT never shortens an entry the engine itself stored.
_MARK_LUA = (
    _LUA_PRELUDE
    + """
local key = KEYS[1]
local ttl = tonumber(ARGV[1])
local cap = tonumber(ARGV[2])
local pending_ttl = tonumber(ARGV[3])
local now = now_ms()
for j = 5, #ARGV do redis.call('SREM', KEYS[3], ARGV[j]) end
if each_hash('ZADD', key, 'GT', now + ttl, ARGV[4]) > 0 then
  trim(key, now, cap)
  extend_ttl(key, ttl)
end
local pending = redis.call('INCR', KEYS[2])
redis.call('PEXPIRE', KEYS[2], pending_ttl)
return pending
"""
)


# ---------------------------------------------------------------------------------------------
# Connections.


REDIS_CA_CERT_ENV = "REDIS_CA_CERT"  # a private CA bundle for rediss://, unless the URL names one


def connect(
    url: str, *, timeout_s: float = 0.5, retries: int = 1, max_connections: int | None = None
) -> aioredis.Redis:
    """An asyncio Redis client for ``redis://``, ``rediss://`` (TLS) or ``unix://`` URLs, with
    credentials in the URL (``redis://:password@host:6379/0``, ``rediss://user:pw@host``).

    Failures surface within about ``timeout_s x (retries + 1)``: redis-py's default retry
    policy (10 retries with backoff) would stall every request while Redis is down.

    A URL without a password takes it from ``REDIS_PASSWORD`` (and ``REDIS_USERNAME``) when
    set, so Kubernetes can pass it from a Secret without putting it in process arguments.

    TLS: ``rediss://`` verifies the server's certificate and host name against the system CAs,
    or against a private CA bundle named by ``?ssl_ca_certs=/path/ca.crt`` in the URL (what the
    Helm chart passes) or, failing that, by ``REDIS_CA_CERT``. A CA with a URL that is not
    ``rediss://`` is refused here rather than at the first command."""
    parts = urlsplit(url)
    scheme = parts.scheme
    if scheme not in ("redis", "rediss", "unix"):
        raise ValueError(
            f"Redis URL must start with redis://, rediss:// or unix://: {redact_url(url)!r}"
        )
    kwargs: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), retries),
        "decode_responses": False,
    }
    if max_connections is not None:
        kwargs["max_connections"] = max_connections
    if parts.password is None and os.environ.get("REDIS_PASSWORD"):
        kwargs["password"] = os.environ["REDIS_PASSWORD"]
        if os.environ.get("REDIS_USERNAME"):
            kwargs["username"] = os.environ["REDIS_USERNAME"]
    ca = parse_qs(parts.query).get("ssl_ca_certs", [None])[-1]
    if ca is None and os.environ.get(REDIS_CA_CERT_ENV):
        ca = kwargs["ssl_ca_certs"] = os.environ[REDIS_CA_CERT_ENV]
    if ca is not None and scheme != "rediss":
        raise ValueError(
            f"a Redis CA certificate (ssl_ca_certs or ${REDIS_CA_CERT_ENV}) needs a rediss:// "
            f"URL, got {redact_url(url)!r}"
        )
    return aioredis.from_url(url, **kwargs)


def redact_url(url: str) -> str:
    """The URL with its password replaced by ``***``, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


# ---------------------------------------------------------------------------------------------
# KV events -> script arguments.


_KIND_CODES = {KVEventKind.STORED: b"S", KVEventKind.REMOVED: b"R", KVEventKind.CLEARED: b"C"}


def _event_ops(events: Iterable[KVEvent]) -> list[tuple[bytes, list[bytes]]]:
    """Turns events into (code, hashes) ops, in order; consecutive events of one kind are
    merged. A hash of the wrong size would corrupt the concatenated blob: refused."""
    ops: list[tuple[bytes, list[bytes]]] = []
    for i, event in enumerate(events):
        hashes: list[bytes] = []
        if event.kind is not KVEventKind.CLEARED:
            for h in event.block_hashes:
                if len(h) != BLOCK_HASH_BYTES:
                    raise ValueError(
                        f"event {i}: block hashes must be {BLOCK_HASH_BYTES} raw bytes"
                    )
                hashes.append(bytes(h))
        code = _KIND_CODES[event.kind]
        if ops and ops[-1][0] == code and code != b"C":
            ops[-1][1].extend(hashes)
        else:
            ops.append((code, hashes))
    return ops


def _split_by_medium(events: Iterable[KVEvent]) -> dict[Medium, list[KVEvent]]:
    """Each tier's events, in order. "cleared" (an engine re-announcing its cache) clears its
    pool and its host tier; the shared store belongs to no engine and is never cleared by one
    (its entries expire)."""
    split: dict[Medium, list[KVEvent]] = {m: [] for m in Medium}
    for event in events:
        if event.kind is KVEventKind.CLEARED:
            split[Medium.GPU].append(event)
            split[Medium.CPU].append(event)
        else:
            split[event.medium].append(event)
    return split


def _batches(ops: list[tuple[bytes, list[bytes]]], limit: int) -> list[list[bytes]]:
    """Script argument lists (after the fixed head): (code, concatenated hashes) pairs, at most
    ``limit`` hashes per list."""
    batches: list[list[bytes]] = [[]]
    room = limit
    for code, hashes in ops:
        start = 0
        while True:
            if room <= 0:
                batches.append([])
                room = limit
            part = hashes[start : start + room]
            batches[-1] += [code, b"".join(part)]
            room -= max(1, len(part))
            start += len(part)
            if start >= len(hashes):
                break
    return batches


def _hash_blob(block_hashes: Sequence[bytes]) -> bytes:
    blob = b"".join(block_hashes)
    if len(blob) != BLOCK_HASH_BYTES * len(block_hashes) or (
        block_hashes and set(map(len, block_hashes)) != {BLOCK_HASH_BYTES}
    ):
        raise ValueError(f"block hashes must be {BLOCK_HASH_BYTES} raw bytes each")
    return blob


def _check_ttl(name: str, value: float) -> int:
    if not value > 0:
        raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
    return max(1, int(value * 1000))


class KVIndexPublisher:
    """Engine side: heartbeats and KV events into Redis.

    ``apply_events`` for one engine must be called from one task at a time, in event order
    (the engine's event queue is the order of truth)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: RedisKeys | None = None,
        *,
        block_ttl_s: float = DEFAULT_BLOCK_TTL_S,
        max_blocks_per_engine: int = DEFAULT_MAX_BLOCKS_PER_ENGINE,
    ) -> None:
        if max_blocks_per_engine <= 0:
            raise ValueError(f"max_blocks_per_engine must be > 0, got {max_blocks_per_engine}")
        self._redis = redis
        self.keys = keys or RedisKeys()
        self._block_ttl_ms = _check_ttl("block_ttl_s", block_ttl_s)
        self._cap = max_blocks_per_engine
        self._apply = redis.register_script(_APPLY_EVENTS_LUA)

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> KVIndexPublisher:
        return cls(connect(url), **kwargs)

    async def aclose(self) -> None:
        await self._redis.aclose()

    async def publish_heartbeat(
        self, hb: EngineHeartbeat, ttl_s: float = DEFAULT_HEARTBEAT_TTL_S
    ) -> bool:
        """Marks the engine live for ``ttl_s`` with its current load. Also resets the routers'
        pending count for it: the heartbeat's ``waiting`` now covers those requests.

        Returns whether the previous heartbeat was still there. False means Redis does not
        know this engine (its first heartbeat, Redis restarted and lost the index, or the
        heartbeat lapsed): the engine should re-announce its whole cache."""
        ttl_ms = _check_ttl("ttl_s", ttl_s)
        registry_ms = int(REGISTRY_TTL_S * 1000)
        k = self.keys
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(k.heartbeat(hb.model, hb.engine_id), hb.to_msgpack(), px=ttl_ms, get=True)
            pipe.sadd(k.engines(hb.model), hb.engine_id)
            pipe.pexpire(k.engines(hb.model), registry_ms)
            pipe.delete(k.pending(hb.model, hb.engine_id))
            pipe.sadd(k.models(), hb.model)
            pipe.pexpire(k.models(), registry_ms)
            results = await pipe.execute()
        return results[0] is not None

    async def apply_events(self, engine_id: str, model: str, events: Iterable[KVEvent]) -> int:
        """Applies stored/removed/cleared events in order, in one round trip. Returns the
        number of entries the engine's index holds afterwards."""
        if not engine_id:
            raise ValueError("engine_id must be a non-empty string")
        events = list(events)
        if events:  # for any subscriber (one PUBLISH; nobody listening costs nothing more)
            await self._redis.publish(self.keys.kv_events(model),
                                      encode_batch(engine_id, time.time(), events))
        by_medium = _split_by_medium(events)
        key = self.keys.blocks(model, engine_id)
        keys = {Medium.GPU: key, Medium.CPU: self.keys.host_blocks(model, engine_id),
                Medium.SHARED: self.keys.shared_blocks(model)}
        head = [self._block_ttl_ms, self._cap]
        batches = [(keys[medium], batch) for medium, medium_events in by_medium.items()
                   for batch in _batches(_event_ops(medium_events), _EVENT_CHUNK)
                   if medium_events]
        if not batches:
            return int(await self._redis.zcard(key))
        if len(batches) == 1 and batches[0][0] == key:
            return int(await self._apply(keys=[key], args=head + batches[0][1]))
        # Large batches, or several tiers: several short script runs (Redis is single-threaded)
        # in one pipeline.
        await self._redis.script_load(_APPLY_EVENTS_LUA)
        async with self._redis.pipeline(transaction=False) as pipe:
            for batch_key, batch in batches:
                pipe.evalsha(self._apply.sha, 1, batch_key, *head, *batch)
            pipe.zcard(key)
            results = await pipe.execute()
        return int(results[-1])

    async def remove_engine(self, engine_id: str, model: str) -> None:
        """Graceful shutdown: the engine stops being live and its index is dropped now. Its id
        stays in the model's engine set, dead, until a router's write-back forgets it (as for
        a crashed engine): a model whose last engine left (scaled to zero) must not look like
        a Redis that lost its data, which routers bridge by routing to the engines they saw."""
        k = self.keys
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(k.heartbeat(model, engine_id), k.blocks(model, engine_id),
                        k.host_blocks(model, engine_id))
            pipe.delete(k.pending(model, engine_id))
            await pipe.execute()


# ---------------------------------------------------------------------------------------------
# Router side.


@dataclass(frozen=True, slots=True)
class EngineMatch:
    heartbeat: EngineHeartbeat
    pending: int  # requests routers sent since the engine's last heartbeat
    matched_blocks: int  # leading blocks of the prompt the engine holds in its KV pool
    reach_blocks: int = 0  # leading blocks it holds in its pool or host-memory tier


@dataclass(frozen=True, slots=True)
class LookupResult:
    engines: list[EngineMatch]  # live engines of the model, in Redis set order
    dead: list[str]  # engine ids registered but with no live heartbeat
    server_time_ms: int
    shared_blocks: int = 0  # leading blocks in the model's shared KV store (every engine's)


class KVIndexReader:
    """Router side: one-round-trip lookups and the write-back of a routing choice."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: RedisKeys | None = None,
        *,
        max_blocks_per_engine: int = DEFAULT_MAX_BLOCKS_PER_ENGINE,
    ) -> None:
        self._redis = redis
        self.keys = keys or RedisKeys()
        self._cap = max_blocks_per_engine
        self._lookup = redis.register_script(_LOOKUP_LUA)
        self._mark = redis.register_script(_MARK_LUA)
        # Each engine's latest heartbeat blob and its decoding: lookups between two heartbeats
        # (most of them) decode nothing. One entry per engine id, not per blob: a heartbeat
        # changes every interval, so a cache of blobs would fill with stale ones.
        self._decoded: dict[bytes, tuple[bytes, EngineHeartbeat]] = {}

    async def lookup(self, model: str, block_hashes: Sequence[bytes]) -> LookupResult:
        """For every live engine of ``model``: its heartbeat, pending count and how many
        leading blocks of ``block_hashes`` it holds. One EVALSHA (plus a SCRIPT LOAD the first
        time a server sees the script). Malformed heartbeats are skipped as dead."""
        packed = await self._lookup(
            keys=[self.keys.engines(model)],
            args=[self.keys.model_prefix(model), _hash_blob(block_hashes)],
        )
        try:
            raw = msgpack.unpackb(packed, raw=True, strict_map_key=False)
            if isinstance(raw[1], dict):  # cmsgpack encodes an empty Lua table as a map
                raw[1] = []
        except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
            raise ResponseError(f"malformed lookup reply: {exc!r}") from None
        engines: list[EngineMatch] = []
        dead = [_text(d) for d in raw[1]]
        for i in range(3, len(raw) - 4, 5):
            hb = self._heartbeat(raw[i], raw[i + 1])
            if hb is None or hb.model != model:
                dead.append(_text(raw[i]))
                continue
            engines.append(EngineMatch(hb, int(raw[i + 2]), int(raw[i + 3]), int(raw[i + 4])))
        return LookupResult(engines, dead, int(raw[0]), int(raw[2]))

    async def mark(
        self,
        model: str,
        engine_id: str,
        block_hashes: Sequence[bytes],
        *,
        ttl_s: float = DEFAULT_PROVISIONAL_TTL_S,
        pending_ttl_s: float = DEFAULT_PENDING_TTL_S,
        forget: Sequence[str] = (),
    ) -> int:
        """Records a routing choice at once: ``engine_id`` provisionally holds the blocks
        (never shortening what the engine itself stored), its pending count goes up by one,
        and ``forget`` (dead engine ids from a lookup) leave the model's engine set. Returns
        the new pending count."""
        k = self.keys
        args: list[Any] = [
            _check_ttl("ttl_s", ttl_s),
            self._cap,
            _check_ttl("pending_ttl_s", pending_ttl_s),
            _hash_blob(block_hashes),
            *forget,
        ]
        keys = [k.blocks(model, engine_id), k.pending(model, engine_id), k.engines(model)]
        return int(await self._mark(keys=keys, args=args))

    async def next_counter(self, model: str) -> int:
        """A counter shared by every router replica (round-robin)."""
        return int(await self._redis.incr(self.keys.round_robin(model)))

    async def live_engines(self, model: str) -> LookupResult:
        return await self.lookup(model, ())

    async def models(self) -> list[str]:
        return sorted(_text(m) for m in await self._redis.smembers(self.keys.models()))

    async def ping(self) -> bool:
        return bool(await self._redis.ping())

    def _heartbeat(self, engine_id: bytes, blob: bytes) -> EngineHeartbeat | None:
        cached = self._decoded.get(engine_id)
        if cached is not None and cached[0] == blob:
            return cached[1]
        try:
            hb = EngineHeartbeat.from_msgpack(blob)
        except ValueError:
            return None
        if len(self._decoded) >= 4096:  # engine ids come and go: bounded all the same
            self._decoded.clear()
        self._decoded[engine_id] = (blob, hb)
        return hb


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
