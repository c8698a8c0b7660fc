"""The Redis layout shared by engines (writers) and routers (readers).

Keys (``ns`` defaults to ``pagoda``; ``{model}`` is a Redis Cluster hash tag, so every key of
one model lives in one slot and the Lua scripts below may touch them together)::

    key                               type    written by        expires
    --------------------------------  ------  ----------------  -------------------------------
    ns:models                         SET     engine heartbeat  1 h after the last heartbeat
    ns:{model}:engines                SET     engine heartbeat  1 h after the last heartbeat;
                                              (router SREMs members whose heartbeat is gone)
    ns:{model}:hb:<engine_id>         STRING  engine heartbeat  heartbeat TTL (engine died ->
                                              (msgpack)                  key gone -> not live)
    ns:{model}:blk:<engine_id>        ZSET    KV events,        block TTL after the last store;
                                              router write-back member = 16-byte block hash,
                                                                score = expiry (Redis ms clock)
    ns:{model}:pend:<engine_id>       STRING  router write-back pending TTL; deleted by the
                                              (INCR)            engine's next heartbeat
    ns:{model}:rr                     STRING  round-robin INCR  never (one integer per model)
    ns:{model}:lora                   HASH    router (gateway's never (the runtime LoRA adapters:
                                              load/unload)               name -> JSON {"path"})
    ns:{model}:lora-gen               STRING  router (INCR on   never (engines re-read the hash
                                              each change)               when it moves)
    ns:{model}:lora-bad               HASH    an engine whose   never; cleared by the router's
                                              load of a         (re)register or unregister
                                              registered        (name -> JSON {"path", "error",
                                              adapter failed     "engine"}: not loaded again)
    ns:{model}:held                   ZSET    router, for       member = request id held at a
                                              gateways waiting  gateway for want of an engine,
                                              for an engine     score = when it stops counting
                                                                (router ms clock); key: 1 min
    ns:{model}:hits:<bucket>          HASH    router            engine id -> prefix blocks the
                                              (prefix hits)     router sent it that hit; one
                                                                hash per time bucket, expiring
                                                                after the hit window
    ns:deletion-cost                  STRING  router (SET NX)   one replica's turn at writing
                                                                pod-deletion-cost annotations

Why one sorted set per engine rather than one key per block: every entry carries its own expiry
(the score), an engine's whole index can be capped and dropped as one key, and a lookup is a
search per engine over the prompt's chain, not a walk of it (cached prefixes are prefix-closed:
an engine that holds block i of a chain holds blocks 0..i-1 too; a hole left by an eviction
race can make the count wrong for that engine, which only steers routing: the engine's own
prefix cache decides what is really reused).

Bounds. An entry lives ``block_ttl_s`` after its last "stored" event (or ``provisional_ttl_s``
after a router's write-back), and is deleted at once by a "removed" event. Every write drops
expired entries of that engine and trims the set to ``max_blocks_per_engine`` (lowest expiry
first), and the set itself expires ``block_ttl_s`` after its last store. So the index is at most
``engines x max_blocks_per_engine`` entries, and an engine that disappears leaves nothing behind
after ``block_ttl_s``. Its entries are ignored as soon as its heartbeat key expires.

Times are Redis server time (``TIME`` inside the scripts), so engine and router clocks never
need to agree.

Lookup (``KVIndexReader.lookup``) is one EVALSHA, whatever the prompt length: the script reads
every live engine's heartbeat and pending count (two MGETs), asks each engine's sorted set for
the prompt's first and last block (one ZMSCORE: settles engines holding none or all of it), and
searches the rest 4-ary (about log4(blocks) more ZMSCOREs of 3 members). Hashes travel as one
concatenated argument and the reply is one msgpack string, so a long prompt costs the client
almost nothing. The script only reads. Requires Redis >= 6.2 (ZMSCORE, ZADD GT).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote

DEFAULT_NAMESPACE = "pagoda"
DEFAULT_HEARTBEAT_TTL_S = 10.0  # engines should publish every ttl/3 or faster
DEFAULT_BLOCK_TTL_S = 600.0
DEFAULT_PROVISIONAL_TTL_S = 60.0
DEFAULT_PENDING_TTL_S = 5.0
DEFAULT_MAX_BLOCKS_PER_ENGINE = 1 << 18
REGISTRY_TTL_S = 3600.0



@dataclass(frozen=True, slots=True)
class RedisKeys:
    """Key names for one deployment namespace. Model names are percent-encoded where they
    contain characters that would break the layout (braces, whitespace, '%')."""

    namespace: str = DEFAULT_NAMESPACE

    def __post_init__(self) -> None:
        if not self.namespace or any(c in self.namespace for c in "{}: \t\r\n"):
            raise ValueError(
                f"namespace must be non-empty without braces, colons or spaces: {self.namespace!r}"
            )

    def models(self) -> str:
        return f"{self.namespace}:models"

    def model_prefix(self, model: str) -> str:
        if not model:
            raise ValueError("model must be a non-empty string")
        return f"{self.namespace}:{{{quote(model, safe='/:._-@+=')}}}:"

    def engines(self, model: str) -> str:
        return self.model_prefix(model) + "engines"

    def heartbeat(self, model: str, engine_id: str) -> str:
        return self.model_prefix(model) + "hb:" + engine_id

    def blocks(self, model: str, engine_id: str) -> str:
        return self.model_prefix(model) + "blk:" + engine_id

    def host_blocks(self, model: str, engine_id: str) -> str:
        """The engine's host-memory tier (KV events with medium CPU): a set like ``blocks``."""
        return self.model_prefix(model) + "hblk:" + engine_id

    def shared_blocks(self, model: str) -> str:
        """The model's shared KV store (medium SHARED): one set for all engines."""
        return self.model_prefix(model) + "sblk"

    def kv_events(self, model: str) -> str:
        """Pub/sub channel: every engine's KV event batches, for any subscriber (vLLM's shape:
        ``services.protocol.kv_events.encode_batch``)."""
        return self.model_prefix(model) + "kvev"

    def pending(self, model: str, engine_id: str) -> str:
        return self.model_prefix(model) + "pend:" + engine_id

    def round_robin(self, model: str) -> str:
        return self.model_prefix(model) + "rr"

    def lora_adapters(self, model: str) -> str:
        return self.model_prefix(model) + "lora"

    def lora_generation(self, model: str) -> str:
        return self.model_prefix(model) + "lora-gen"

    def lora_quarantine(self, model: str) -> str:
        return self.model_prefix(model) + "lora-bad"

    def held(self, model: str) -> str:
        return self.model_prefix(model) + "held"

    def hits(self, model: str, bucket: int) -> str:
        return self.model_prefix(model) + f"hits:{bucket}"

    def deletion_cost_turn(self) -> str:
        return f"{self.namespace}:deletion-cost"
