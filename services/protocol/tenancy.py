"""The tenant a bearer key stands for, and the cache salt a request of that tenant hashes with.

One rule for every service that derives it (the gateway, which checks the key, and the router's
endpoint picker, which sees the key an Envoy gateway forwards): with a tenant, the salt is
``tenant:<id>``, plus ``/<cache_salt>`` when the request names one, so two tenants never share
cached prefixes even with the same ``cache_salt``; without one the request's salt is used as is.
The id is one-way: safe to log and to put in the chain, never the key.
"""

from __future__ import annotations

import hashlib

_TENANT_DOMAIN = b"pagoda/tenant/v1\x00"


def tenant_id(api_key: str) -> str:
    """A stable, one-way id for a key: safe to use as a salt and to put in logs."""
    return hashlib.sha256(_TENANT_DOMAIN + api_key.encode()).hexdigest()[:32]


def cache_salt_for(tenant: str | None, requested: str | None) -> str | None:
    """The salt the block-hash chain and the engine use for this request (see module doc)."""
    if tenant is None:
        return requested
    return f"tenant:{tenant}" if requested is None else f"tenant:{tenant}/{requested}"


def bearer_token(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header; None when there is none."""
    scheme, _, token = (header or "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None
