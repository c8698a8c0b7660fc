"""Connectors by name, built lazily from their module path (a connector's package is imported
only when it is used, and never imports this package's callers back).

A new connector is one module and one line here."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from services.engine.kv_connector.base import ConnectorContext, KVConnector
from services.engine.kv_connector.multi import MultiConnector

if TYPE_CHECKING:
    from services.engine.kv_connector.config import KVTransferConfig

MULTI = "MultiConnector"
TIERS = "PagodaTiersConnector"
PD = "PagodaPDConnector"
PD_STORE = "PagodaStorePDConnector"
PD_CONNECTORS = (PD, PD_STORE)  # the P/D transports: TCP between engines, the shared store
# name -> "module:class"; the class is built as ``cls(spec, context)``. MULTI is a name only:
# its parts are built one by one and composed (``build``).
CONNECTORS: dict[str, str] = {
    TIERS: "services.engine.kv_offload.tiers:KVTiers",
    PD: "services.engine.kv_connector.pd:PagodaPDConnector",
    PD_STORE: "services.engine.kv_offload.pd_store:PagodaStorePDConnector",
    MULTI: "",
}


def build(specs: list[KVTransferConfig], context: ConnectorContext) -> KVConnector | None:
    """The engine's connector for ``specs`` (leaves, in order): None, one, or a MultiConnector
    of several. A connector that fails to start closes the ones built before it."""
    built: list[KVConnector] = []
    try:
        for spec in specs:
            built.append(_load(spec.kv_connector)(spec, context))
    except BaseException:
        for connector in built:
            connector.close()
        raise
    if len(built) < 2:
        return built[0] if built else None
    _lend_host_tier(built)
    return MultiConnector(built)


def _lend_host_tier(built: list[KVConnector]) -> None:
    """A connector that serves peers by hash (``peers``) serves the KV tiers' host store too
    (``host``): a prefix the pool evicted is still this engine's to lend."""
    host = next((h for c in built if (h := getattr(c, "host", None)) is not None), None)
    for c in built:
        peers = getattr(c, "peers", None)
        if peers is not None:
            peers.host = host


def _load(name: str) -> type:
    module, cls = CONNECTORS[name].split(":")
    return getattr(importlib.import_module(module), cls)
