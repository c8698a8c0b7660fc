"""MACs under the internal credential: proof that a peer holds it without sending it, and
grants that only a holder could have written.

The KV transfer port speaks raw TCP to whatever address a request's ``kv_transfer_params``
name, so it never sends a token: each side proves it holds one by a MAC of the other side's
fresh nonce (``prove`` / ``proven``), and the address a decode engine may pull from comes in
a grant the prefill engine signed (``sign`` / ``signed``), which a public client cannot forge.

Every MAC is HMAC-SHA256 under one token over a label (what the MAC is for, so a MAC of one
kind is never accepted as another) and the canonical JSON of its fields. The first token signs;
every token is tried when checking (rotation, as ``internal_auth``), in constant time per token
and without an early exit.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets

from services.common.internal_auth import InternalCredential

NONCE_BYTES = 16
MAC_HEX_CHARS = 64


def nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def _mac(token: str, label: str, fields: tuple[object, ...]) -> str:
    text = json.dumps([label, *fields], separators=(",", ":"), sort_keys=True)
    return hmac.new(token.encode(), text.encode(), hashlib.sha256).hexdigest()


def sign(credential: InternalCredential, label: str, *fields: object) -> str:
    """The MAC of ``fields`` under the credential's first token (64 hex characters)."""
    return _mac(credential.tokens[0], label, fields)


def signed(credential: InternalCredential, label: str, tag: object, *fields: object) -> bool:
    """Whether ``tag`` is the MAC of ``fields`` under one of the credential's tokens."""
    if not isinstance(tag, str) or len(tag) != MAC_HEX_CHARS:
        return False
    found = False
    for token in credential.tokens:  # every one compared: no early exit
        found |= hmac.compare_digest(_mac(token, label, fields), tag)
    return found
