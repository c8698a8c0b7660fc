"""The ``KVConnector`` contract: how KV gets into the pool from outside it, and out of it.

The engine owns one connector (several compose: ``multi.MultiConnector``). The engine thread
calls both of its sides, in this order within each step:

scheduler side (``Scheduler``)
    * ``get_finished`` first (the worker's report, read by the scheduler: one process holds
      both sides), then for each waiting request that reads the prefix cache:
    * ``get_num_new_matched_tokens(request, num_computed_tokens)``: how many tokens after the
      pool's hit the connector can deliver, and whether asynchronously. Only asynchronous
      loads exist today: a request with tokens to load gets blocks for them and waits in the
      scheduler's "waiting for KV" state (``Scheduler.loading``) while the step goes on.
    * ``update_state_after_alloc(request, block_ids, num_external_tokens)``: called for every
      admitted request once its blocks are allocated (``num_external_tokens`` is 0 unless it
      loads). ``block_ids`` is all of the request's blocks; those to fill start at
      ``num_computed_tokens // block_size``.
    * ``build_connector_meta()``: at the end of ``schedule``, what the worker side needs for
      the step (the loads just planned); the engine hands it to ``start_load_kv``. No step
      has run since the schedule's preemptions: blocks they freed are not written yet.
    * ``take_announced()``: after each step, params to hand a running request's client
      before it finishes (a streamed P/D prefill: where its KV can be pulled while it runs).
    * ``request_finished(request, block_ids)``: a request finished or was aborted. Returns
      ``(delay_free, kv_transfer_params)``: with ``delay_free`` the scheduler keeps its blocks
      until ``get_finished`` names it in ``sending`` (or ``kv_transfer_timeout`` passes);
      the params are kept on the request (``kv_transfer_params``; P/D will hand them to the
      client: where to fetch the blocks).
      A request aborted while it loads is freed once its load is reported, whatever this
      returns. Held blocks are checked at each ``schedule``: an idle engine frees them at its
      next step.

worker side (``LLMEngine``)
    * ``start_load_kv(metadata)``: start the loads the metadata names, into their blocks. The
      engine calls it once no step that was in flight when those blocks were allocated can
      still write to them (with async scheduling: after that step is applied).
    * ``save_kv()``: after a step's result was applied; every block the pool has cached by then
      holds final KV (the block manager lists the new ones: ``take_new_cached``).
    * ``get_finished(timeout)``: the transfers done since the last call. A load reported in
      ``recving`` is over for good: its blocks are no longer written, the count says how many
      tokens arrived (fewer than promised: the rest is recomputed). A request whose load was
      aborted is still reported (its blocks are freed then, never earlier).

Invariants: a connector never frees or allocates pool blocks itself (it may ``hold`` and
``release`` a block it reads); the last prompt token is never loaded (it is computed for its
logits); a connector must not import the engine's core (it reads requests and the block
manager through Protocols).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from services.protocol.block_hash import BlockHash
from services.protocol.kv_events import KVEvent


class ConnectorRequest(Protocol):
    """What a connector reads of the engine's ``Request``."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    block_hashes: list[BlockHash]
    num_cached_tokens: int
    num_computed_tokens: int
    num_preemptions: int  # grows each time its blocks are freed to be recomputed
    # The client's params while it runs (P/D: where to pull its prompt's KV, or that its
    # blocks are to be held), the connector's answer once it finished.
    kv_transfer_params: dict[str, Any] | None

    @property
    def num_tokens(self) -> int: ...


@dataclass(slots=True)
class FinishedTransfers:
    """``get_finished``'s report (vLLM's ``(finished_sending, finished_recving)``)."""

    sending: set[str] = field(default_factory=set)  # held blocks that may be freed now
    recving: dict[str, int] = field(default_factory=dict)  # request id -> tokens loaded

    def __bool__(self) -> bool:
        return bool(self.sending or self.recving)


@dataclass(slots=True)
class ConnectorContext:
    """What the engine hands a connector it builds (``registry.build``)."""

    engine_config: Any  # EngineConfig (the core is not imported here)
    kv_caches: list[tuple[Any, Any]]  # the pool: (key, value) tensors per layer
    block_manager: Any  # the engine's BlockManager (each connector types what it uses)
    model_name: str
    seed: bytes  # the block-hash chain's seed (model, block size, no salt)
    record_events: bool = False  # publish KV events of what the connector holds
    model_path: str | None = None  # the weights' directory (the shared store's namespace)
    compute_rate: Any = None  # a ComputeRate the engine's steps feed (what a pull must beat)


class KVConnector(Protocol):
    """One mover of KV (see the module docstring for when each method is called)."""

    # -- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int, bool]: ...

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int],
                                 num_external_tokens: int) -> None: ...

    def build_connector_meta(self) -> Any: ...

    def request_finished(self, request: ConnectorRequest,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]: ...

    def take_announced(self) -> dict[str, dict[str, Any]]: ...

    # -- worker side -----------------------------------------------------------------------

    def start_load_kv(self, metadata: Any) -> None: ...

    def save_kv(self) -> None: ...

    def get_finished(self, timeout: float = 0.0) -> FinishedTransfers: ...

    # -- observability and lifetime ----------------------------------------------------------

    def take_events(self) -> list[KVEvent]: ...

    def snapshot_events(self) -> list[KVEvent]: ...

    def close(self) -> None: ...
