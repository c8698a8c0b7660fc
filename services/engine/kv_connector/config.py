"""``--kv-transfer-config``: vLLM's JSON object, read and checked once, at start.

Keys (vLLM's names): ``kv_connector`` (a name in ``registry.CONNECTORS``), ``kv_role``
(``kv_producer``: saves only, ``kv_consumer``: loads only, ``kv_both``), and
``kv_connector_extra_config`` (an object, the connector's own settings); Pagoda adds
``kv_transfer_timeout`` (seconds a finished request's blocks may be held for sending).

``MultiConnector`` takes its parts as ``kv_connector_extra_config.connectors``, a list of such
objects, tried in order for loads (vLLM's shape). ``PagodaTiersConnector`` (the KV tiers) takes
the tier flags' names as its extra keys (``kv_offloading_size``, ``kv_store_url``,
``kv_store_timeout_s``). ``PagodaPDConnector`` (P/D over TCP) and ``PagodaStorePDConnector``
(P/D through the shared KV store) check their own keys (``checked_extra``).

Anything else is refused with a ``ValueError`` naming the key (``kv_transfer_config.<key>``),
which the engine server turns into exit status 2 and ``LLM(...)`` raises.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from services.common.cli import json_object
from services.engine.kv_connector.registry import CONNECTORS, MULTI, PD_CONNECTORS

PREFIX = "kv_transfer_config"
DEFAULT_TIMEOUT_S = 120.0
_KEYS = ("kv_connector", "kv_role", "kv_connector_extra_config", "kv_transfer_timeout")


class KVRole(StrEnum):
    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"
    BOTH = "kv_both"

    @property
    def loads(self) -> bool:
        return self is not KVRole.PRODUCER

    @property
    def saves(self) -> bool:
        return self is not KVRole.CONSUMER


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: KVRole = KVRole.BOTH
    kv_connector_extra_config: Mapping[str, Any] = field(default_factory=dict)
    kv_transfer_timeout: float = DEFAULT_TIMEOUT_S
    # MultiConnector: its parts, in order (parsed from extra_config["connectors"])
    connectors: tuple[KVTransferConfig, ...] = ()

    @classmethod
    def parse(cls, value: KVTransferConfig | Mapping[str, Any] | str) -> KVTransferConfig:
        """From a JSON text (the flag), a dict (``LLM(kv_transfer_config={...})``) or itself."""
        if isinstance(value, KVTransferConfig):
            return value
        config = _from_mapping(value, PREFIX)
        transports = [leaf.kv_connector for leaf in config.leaves()
                      if leaf.kv_connector in PD_CONNECTORS]
        if len(transports) > 1:  # both would answer a prefill leg: which params win is luck
            raise ValueError(f"{PREFIX}.kv_connector: one P/D transport per engine, got "
                             f"{', '.join(transports)}")
        return config

    def leaves(self) -> Iterator[KVTransferConfig]:
        """The connectors to build, in order (a MultiConnector's parts, flattened)."""
        if self.kv_connector == MULTI:
            for part in self.connectors:
                yield from part.leaves()
        else:
            yield self


def _from_mapping(raw: object, where: str) -> KVTransferConfig:
    raw = json_object(raw, where)
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise ValueError(f"{where}.{unknown[0]} is not a known key (known: {', '.join(_KEYS)})")
    name = raw.get("kv_connector")
    if name not in CONNECTORS:
        raise ValueError(f"{where}.kv_connector must be one of {', '.join(CONNECTORS)}, "
                         f"got {name!r}")
    try:
        role = KVRole(raw.get("kv_role", KVRole.BOTH))
    except ValueError:
        raise ValueError(f"{where}.kv_role must be one of "
                         f"{', '.join(r.value for r in KVRole)}, got {raw['kv_role']!r}") from None
    extra = raw.get("kv_connector_extra_config", {})
    if not isinstance(extra, Mapping):
        raise ValueError(  # noqa: TRY004 - bad configuration is a ValueError here
            f"{where}.kv_connector_extra_config must be a JSON object, got "
                         f"{type(extra).__name__}")
    timeout = raw.get("kv_transfer_timeout", DEFAULT_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"{where}.kv_transfer_timeout must be a positive number of seconds, "
                         f"got {timeout!r}")
    parts = _parts(extra, f"{where}.kv_connector_extra_config") if name == MULTI else ()
    return KVTransferConfig(name, role, dict(extra), float(timeout), parts)


def _parts(extra: Mapping[str, Any], where: str) -> tuple[KVTransferConfig, ...]:
    raw = extra.get("connectors")
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{where}.connectors must be a non-empty list of connector objects")
    return tuple(_from_mapping(part, f"{where}.connectors[{i}]") for i, part in enumerate(raw))


def checked_extra(extra: Mapping[str, Any], kinds: Mapping[str, type | tuple[type, ...]],
                  connector: str) -> dict[str, Any]:
    """A connector's ``kv_connector_extra_config``: only the keys of ``kinds``, each of its
    type, numbers positive (``port`` may be 0: any); else a ``ValueError`` naming the key."""
    where = f"{PREFIX}.kv_connector_extra_config"
    for key, value in extra.items():
        kind = kinds.get(key)
        if kind is None:
            raise ValueError(f"{where}.{key} is not a key of {connector} "
                             f"(known: {', '.join(kinds)})")
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ValueError(  # noqa: TRY004 - bad configuration is a ValueError here
                f"{where}.{key} has the wrong type: {value!r}")
        if kind is not str and not value > 0 and not (key == "port" and value == 0):
            raise ValueError(f"{where}.{key} must be positive, got {value!r}")
    return dict(extra)
