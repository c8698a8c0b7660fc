"""The registry of runtime-loaded LoRA adapters in Redis (``redis_schema.RedisKeys``:
``lora_adapters``, a hash name -> JSON ``{"path"}``, and ``lora_generation``, a counter moved by
every change). The router writes it (the gateway's load and unload go through it); engines read
it: each compares the counter every heartbeat and, when it moved (or when the engine starts),
loads what is registered and unloads what is no longer, so replicas agree and an engine that
starts or restarts gets the adapters loaded at that time.

An adapter whose load failed on an engine (refused, or an engine error) is *quarantined*
(``lora_quarantine``: name -> JSON ``{"path", "error", "engine"}``): no engine loads it again,
at its next sync or after a restart, until the router registers it again (the same path: the
files were mended) or unregisters it; both clear the entry and move the counter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import redis.asyncio as aioredis

from services.protocol.redis_schema import RedisKeys

_MAX_ERROR = 1000  # characters of an engine's answer kept

# Register only if the name is free or holds this path; answers 1 (done), 0 (another path).
# Registering again clears a quarantine (and moves the counter, so engines try it again).
_REGISTER_LUA = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
if old and old ~= ARGV[2] then return 0 end
local cleared = redis.call('HDEL', KEYS[3], ARGV[1])
if not old then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
if (not old) or cleared == 1 then
  redis.call('INCR', KEYS[2])
end
return 1
"""


@dataclass(frozen=True, slots=True)
class Quarantined:
    """A registered adapter that failed to load on ``engine``, with the answer it gave."""

    path: str
    error: str
    engine: str


class AdapterRegistry:
    def __init__(self, redis: aioredis.Redis, keys: RedisKeys | None = None) -> None:
        self.redis = redis
        self.keys = keys or RedisKeys()
        self._register = redis.register_script(_REGISTER_LUA)

    async def generation(self, model: str) -> int:
        value = await self.redis.get(self.keys.lora_generation(model))
        return int(value or 0)

    async def entries(self, model: str) -> dict[str, str]:
        """Registered adapter name -> its path."""
        raw = await self.redis.hgetall(self.keys.lora_adapters(model))
        out = {}
        for name, value in raw.items():
            try:
                out[_text(name)] = json.loads(value)["path"]
            except (ValueError, KeyError, TypeError):
                continue  # not ours: never let one bad entry stop the others
        return out

    async def register(self, model: str, name: str, path: str) -> bool:
        """False when ``name`` is registered with another path."""
        keys = [self.keys.lora_adapters(model), self.keys.lora_generation(model),
                self.keys.lora_quarantine(model)]
        return bool(await self._register(keys=keys, args=[name, json.dumps({"path": path})]))

    async def unregister(self, model: str, name: str) -> bool:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(self.keys.lora_adapters(model), name)
            pipe.hdel(self.keys.lora_quarantine(model), name)
            pipe.incr(self.keys.lora_generation(model))
            removed, _, _ = await pipe.execute()
        return bool(removed)

    async def quarantine(self, model: str, name: str, entry: Quarantined) -> None:
        """Records that ``name`` (registered with ``entry.path``) failed to load."""
        value = json.dumps({"path": entry.path, "error": entry.error[:_MAX_ERROR],
                            "engine": entry.engine})
        await self.redis.hset(self.keys.lora_quarantine(model), name, value)

    async def quarantined(self, model: str) -> dict[str, Quarantined]:
        """Quarantined adapter name -> why."""
        raw = await self.redis.hgetall(self.keys.lora_quarantine(model))
        out = {}
        for name, value in raw.items():
            try:
                obj = json.loads(value)
                out[_text(name)] = Quarantined(str(obj["path"]), str(obj["error"]),
                                               str(obj["engine"]))
            except (ValueError, KeyError, TypeError):
                continue
        return out


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
