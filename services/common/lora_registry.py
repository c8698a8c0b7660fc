"""The registry of runtime-loaded LoRA adapters in Redis (``redis_schema.RedisKeys``:
``lora_adapters``, a hash name -> JSON ``{"path"}``, and ``lora_generation``, a counter moved by
every change). The router writes it (the gateway's load and unload go through it); engines read
it: each compares the counter every heartbeat and, when it moved (or when the engine starts),
loads what is registered and unloads what is no longer, so replicas agree and an engine that
starts or restarts gets the adapters loaded at that time.
"""

from __future__ import annotations

import json

import redis.asyncio as aioredis

from services.protocol.redis_schema import RedisKeys

# Register only if the name is free or holds this path; answers 1 (done), 0 (another path).
_REGISTER_LUA = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
if old and old ~= ARGV[2] then return 0 end
if not old then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('INCR', KEYS[2])
end
return 1
"""


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
        keys = [self.keys.lora_adapters(model), self.keys.lora_generation(model)]
        return bool(await self._register(keys=keys, args=[name, json.dumps({"path": path})]))

    async def unregister(self, model: str, name: str) -> bool:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(self.keys.lora_adapters(model), name)
            pipe.incr(self.keys.lora_generation(model))
            removed, _ = await pipe.execute()
        return bool(removed)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
