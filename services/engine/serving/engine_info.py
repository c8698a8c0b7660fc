"""The server's one view of the loaded engine, the same whether the core runs inline or in its
own process.

``EngineInfo`` is a frozen snapshot the core builds on its own thread once the engine has
loaded (sent over the pipe in process mode); the event loop never touches the live
``LLMEngine``. ``RequestChecks`` is what the server does with it before a request travels to
the core: the model's limits (a 400 naming the field) and the grammar compile (on a compile
thread, so neither loop waits for it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.engine.engine import check_request
from services.engine.kv_connector.registry import PD_CONNECTORS
from services.engine.structured.compiler import GrammarCompiler
from services.protocol.sampling_params import SamplingParams

if TYPE_CHECKING:
    from services.engine.engine import LLMEngine


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the server needs to know of the loaded engine."""

    model_name: str
    model_path: str
    max_model_len: int
    vocab_size: int  # the LM head's rows (token ids must be below it)
    block_size: int
    num_blocks: int
    eos_token_ids: tuple[int, ...]
    kv_cache_dtype: str  # "float32", "bfloat16", ...
    enable_prefix_caching: bool
    hash_algorithm: str  # a HashAlgorithm value
    kv_role: str = "both"  # disaggregated serving (the heartbeat's): prefill, decode or both
    # The KV transfer port ("host:port") and KV layout digest of a P/D connector that serves
    # blocks (the heartbeat's: the router names this engine as a peer to pull a prefix from).
    kv_transfer_address: str | None = None
    kv_layout: str | None = None

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        """Read on the thread that owns ``engine``."""
        runner, config = engine.runner, engine.config
        return cls(
            model_name=engine.model_name,
            model_path=str(engine.model_path),
            max_model_len=engine.max_model_len,
            vocab_size=runner.model_config.vocab_size,
            block_size=config.block_size,
            num_blocks=runner.num_blocks,
            eos_token_ids=tuple(engine.eos_token_ids),
            kv_cache_dtype=str(runner.dtype).removeprefix("torch."),
            enable_prefix_caching=config.enable_prefix_caching,
            hash_algorithm=config.hash_algorithm.value,
            kv_role=_pd_role(config),
            **_transfer_port(engine),
        )


def _transfer_port(engine: LLMEngine) -> dict[str, str]:
    """The transfer port of a P/D connector that serves blocks, with its layout; else the
    layout of any P/D connector (a decode engine, or P/D through the store: the router pairs
    the legs by it)."""
    connector = engine.kv_connector
    parts = getattr(connector, "connectors", [connector] if connector is not None else [])
    for part in parts:
        address = getattr(part, "transfer_address", None)
        if address is not None:
            return {"kv_transfer_address": address, "kv_layout": part.layout}
    layouts = [part.layout for part in parts if isinstance(getattr(part, "layout", None), str)]
    return {"kv_layout": layouts[0]} if layouts else {}



def _pd_role(config: Any) -> str:
    """The engine's role in disaggregated serving, from its P/D connector's ``kv_role``."""
    roles = {s.kv_role.value for s in config.kv_connector_specs()
             if s.kv_connector in PD_CONNECTORS}
    if roles == {"kv_producer"}:
        return "prefill"
    if roles == {"kv_consumer"}:
        return "decode"
    return "both"

class RequestChecks:
    """The server's checks of a request against the loaded model, before it is submitted."""

    def __init__(self, info: EngineInfo, grammars: GrammarCompiler | None = None) -> None:
        """``grammars``: a compiler to share (thread-safe; inline, the engine's own, so a
        grammar compiles once); by default one of the server's own, as a core in another
        process cannot share its cache."""
        self.info = info
        self.grammars = grammars or GrammarCompiler(
            info.model_path, info.vocab_size, info.eos_token_ids)

    async def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ``BadRequest`` naming the field at fault. A grammar is compiled into the
        cache (or found there) on a compile thread: a slow schema delays only its own request,
        and a bad one is the client's 400 before the request travels."""
        i = self.info
        check_request(prompt_token_ids, params, i.vocab_size, i.max_model_len, i.num_blocks,
                      i.block_size)
        if params.structured_outputs is not None:
            await self.grammars.compile_async(params.structured_outputs)
