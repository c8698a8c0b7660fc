"""Bearer API keys, and the per-tenant cache salt derived from them.

No keys configured means the gateway is open. ``/health``, ``/ready``, ``/metrics`` (and
``/metrics/engines``), ``/openapi.json`` and ``/version`` are always open (probes, scrapers and
schema tools carry no key). Keys are compared in constant time and never logged; only a one-way
tenant id derived from a key ever leaves this module.

Cache isolation: the engine's prefix cache and the router's index key blocks by a hash chain
seeded with ``cache_salt``. With keys configured every request's salt is scoped to its tenant
(``tenant:<id>``, plus ``/<cache_salt>`` when the request names one), so two tenants never
share cached prefixes even when they send the same ``cache_salt``. Without keys the request's
``cache_salt`` is used as is, and requests without one share the cache.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from typing import Any

from aiohttp import web

from services.protocol.openai import OpenAIError
from services.protocol.tenancy import bearer_token, cache_salt_for, tenant_id

__all__ = ["ApiKeyAuth", "TENANT_KEY", "auth_middleware", "cache_salt_for", "tenant_id"]

OPEN_PATHS = frozenset(
    {"/health", "/ready", "/metrics", "/metrics/engines", "/openapi.json", "/version"}
)


class ApiKeyAuth:
    """Checks ``Authorization: Bearer <key>`` against the configured keys."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = [k.encode() for k in keys]
        self._tenants = {k: tenant_id(k.decode()) for k in self._keys}

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, header: str | None) -> str | None:
        """The tenant id of the key in ``header``; None when auth is off. Raises 401."""
        if not self._keys:
            return None
        token = bearer_token(header)
        if token is None:
            raise _unauthorized("missing bearer API key in the Authorization header")
        given = token.encode()
        found = None
        for key in self._keys:  # every key is compared, so timing reveals nothing
            if hmac.compare_digest(given, key):
                found = key
        if found is None:
            raise _unauthorized("invalid API key")
        return self._tenants[found]


def _unauthorized(message: str) -> OpenAIError:
    return OpenAIError(message, status=401, code="invalid_api_key")


# request[TENANT_KEY]: the caller's tenant id, or None when auth is off.
TENANT_KEY = web.RequestKey("tenant", str | None)


def auth_middleware(auth: ApiKeyAuth) -> Any:
    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            request[TENANT_KEY] = None
            return await handler(request)
        try:
            request[TENANT_KEY] = auth.authenticate(request.headers.get("Authorization"))
        except OpenAIError as err:
            return web.json_response(
                err.to_dict(), status=401, headers={"WWW-Authenticate": "Bearer"}
            )
        return await handler(request)

    return middleware
