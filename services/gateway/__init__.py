"""The OpenAI-compatible gateway: ``python -m services.gateway --help``.

One request: auth (bearer keys) -> validate (services.protocol.openai) -> chat template and
tokenization, once -> context-length checks -> block-hash chain (services.protocol.block_hash,
with the tenant-scoped ``cache_salt``) -> router ``POST /route`` -> engine stream
(services.protocol.engine_api), retried on another engine while nothing was generated ->
incremental detokenization and stop strings -> SSE or JSON.

Modules, one job each: ``config`` (flags), ``auth`` (keys, cache salts), ``errors`` (OpenAI
error JSON, body reading), ``models`` (tokenizers, context, block sizes, liveness),
``router_client``, ``engine_client`` (one engine stream), ``choice`` (frames -> text deltas),
``generation`` (n x prompts streams, retries, merging), ``responses`` (OpenAI objects and
chunks), ``sse``, ``prompts`` (templating, tokenizing, length checks), ``api`` (the two
generation routes), ``tokenization`` (/tokenize, /detokenize), ``openapi``, ``metrics``,
``state``, ``server`` (the app factory).
"""
