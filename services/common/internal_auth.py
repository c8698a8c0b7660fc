"""The internal credential: who may call an engine's or a router's routes.

The gateway is the only public door; behind it, every engine and router route except
``/health``, ``/ready`` and ``/metrics`` (probes and scrapers carry no credential) requires
``Authorization: Bearer <token>`` with one of the internal tokens. Without it, any pod in the
cluster could load adapters on every engine, generate under another tenant's ``cache_salt`` and
read ``cached_tokens`` back, or inflate the queue the autoscaler reads.

Where the tokens come from, in this order (duplicates dropped):

    --internal-token-file PATH    one token per line (a mounted Kubernetes Secret); blank lines
                                  and lines starting with '#' are skipped
    $PAGODA_INTERNAL_TOKENS       comma separated

The first token is the one this process sends; every token is accepted. Rotation therefore takes
two at once: add the new token second everywhere (accepted, not yet sent), then make it first
(sent), then drop the old one, rolling the pods between the steps.

No credential configured: the service refuses to start (``MissingCredential``), unless
``--insecure-no-internal-auth`` says the operator wants its internal routes open to anyone who
can reach them (a warning is logged). Tokens are compared in constant time (SHA-256 digests,
every accepted token compared); a 401 names neither the tokens nor how many there are, and no
token is ever logged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from services.common.cli import flag
from services.common.http_errors import json_error

logger = logging.getLogger(__name__)

TOKENS_ENV = "PAGODA_INTERNAL_TOKENS"
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
MIN_TOKEN_CHARS = 16  # a short shared secret could be guessed by anyone who can reach a pod
_MAX_FILE_BYTES = 64 * 1024  # a token file is a few lines; more is a wrong mount
# Printable ASCII without spaces: what an HTTP header carries unchanged.
_TOKEN_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F))

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class MissingCredential(ValueError):
    """No usable internal token is configured (none, a weak one, an unreadable file) and the
    operator did not opt out."""


def token_file_flag() -> Any:
    """The ``internal_token_file`` field of a service's config (one help text for all)."""
    return flag(
        None,
        metavar="PATH",
        help=f"file of internal tokens, one per line (a mounted Secret); with ${TOKENS_ENV} "
        "(comma separated) the tokens this service accepts on its internal routes, the first "
        "one also sent to the others",
    )


def insecure_flag() -> Any:
    """The ``insecure_no_internal_auth`` field of a service's config."""
    return flag(
        False,
        help="start without an internal credential: internal routes answer anyone who can "
        "reach them (default: refuse to start without one)",
    )


@dataclass(frozen=True, slots=True)
class InternalCredential:
    """The tokens of this process: ``tokens[0]`` is sent, all are accepted."""

    tokens: tuple[str, ...]
    _digests: tuple[bytes, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ValueError("an internal credential needs at least one token")
        for i, token in enumerate(self.tokens):
            # The message names the token's position, never its text.
            if len(token) < MIN_TOKEN_CHARS:
                raise ValueError(f"internal token #{i + 1} is shorter than {MIN_TOKEN_CHARS} "
                                 "characters")
            if not set(token) <= _TOKEN_CHARS:
                raise ValueError(f"internal token #{i + 1} has characters other than printable "
                                 "ASCII without spaces")
        object.__setattr__(self, "_digests", tuple(_digest(t) for t in self.tokens))

    def __repr__(self) -> str:  # never the tokens, in a log or a traceback
        return "InternalCredential(<redacted>)"

    def headers(self) -> dict[str, str]:
        """The header a client sends to another service's internal routes."""
        return {"Authorization": f"Bearer {self.tokens[0]}"}

    def accepts(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header carries one of the tokens, in time that depends
        on neither the tokens nor which one matched."""
        scheme, _, given = (authorization or "").partition(" ")
        digest = _digest(given.strip())  # a fixed-length digest: no length leaks
        found = False
        for accepted in self._digests:  # every one compared: no early exit
            found |= hmac.compare_digest(digest, accepted)
        return found and scheme.lower() == "bearer"


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


def read_tokens(token_file: str | None, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The configured tokens (file first, then the environment), duplicates dropped."""
    tokens: list[str] = []
    if token_file:
        tokens += _file_tokens(Path(token_file))
    tokens += [t.strip() for t in environ.get(TOKENS_ENV, "").split(",")]
    return tuple(dict.fromkeys(t for t in tokens if t))


def _file_tokens(path: Path) -> list[str]:
    # Symlinks are followed on purpose: a Kubernetes Secret volume is a chain of them.
    try:
        with path.open("rb") as f:
            data = f.read(_MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise MissingCredential(f"internal token file {str(path)!r}: {exc.strerror}") from None
    if len(data) > _MAX_FILE_BYTES:
        raise MissingCredential(f"internal token file {str(path)!r} is larger than "
                                f"{_MAX_FILE_BYTES} bytes")
    lines = (line.strip() for line in data.decode("utf-8", "replace").splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def resolve(token_file: str | None, insecure: bool, service: str,
            environ: Mapping[str, str] | None = None) -> InternalCredential | None:
    """The credential of ``service`` from its flags and the environment; None only when the
    operator opted out with ``--insecure-no-internal-auth``. Raises ``MissingCredential``
    otherwise."""
    tokens = read_tokens(token_file, os.environ if environ is None else environ)
    if tokens:
        try:
            return InternalCredential(tokens)
        except ValueError as exc:  # a weak token: refused at start, as a missing one is
            raise MissingCredential(f"{service}: {exc}") from None
    if not insecure:
        raise MissingCredential(
            f"{service}: no internal credential: set ${TOKENS_ENV} or --internal-token-file "
            "(the Secret the chart mounts; `make serve` makes one per run), or pass "
            "--insecure-no-internal-auth to serve internal routes to anyone who can reach them")
    logger.warning("%s: --insecure-no-internal-auth: internal routes answer anyone who can "
                   "reach this port", service)
    return None


def ensure_tokens(environ: MutableMapping[str, str]) -> InternalCredential:
    """The credential in ``environ``, after putting a new random token there when it has none:
    what a launcher (``services.serve``, a benchmark) does before starting the services it
    runs, so that only they (and it) can call one another."""
    if not environ.get(TOKENS_ENV, "").strip():
        environ[TOKENS_ENV] = secrets.token_urlsafe(32)
    return InternalCredential(read_tokens(None, environ))


def export(credential: InternalCredential | None, environ: MutableMapping[str, str]) -> None:
    """Puts the credential's tokens (read from a file, say) into ``environ``: the parts of a
    service that read the environment (the engine's KV transfer port, its node-group join)
    and its children then hold the same credential as its routes."""
    if credential is not None:
        environ[TOKENS_ENV] = ",".join(credential.tokens)


def client_headers(credential: InternalCredential | None) -> dict[str, str]:
    """What a client sends: the credential's header, or nothing when auth is off."""
    return {} if credential is None else credential.headers()


def refused(status: int) -> bool:
    """Whether a peer's answer refuses this process's credential: the operator's fault
    (Secrets that differ), never the client's, so the caller answers it as a 5xx."""
    return status in (401, 403)


def middlewares(credential: InternalCredential | None) -> list[Any]:
    """The middleware list a service adds: none when the operator opted out."""
    return [] if credential is None else [middleware(credential)]


def middleware(credential: InternalCredential) -> Any:
    """Requires the credential on every route but ``OPEN_PATHS``. The route the request
    resolved to decides, not the path's spelling; a request that matches no route needs the
    credential too, so the routes cannot be probed without it."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        if resource is not None and resource.canonical in OPEN_PATHS:
            return await handler(request)
        if not credential.accepts(request.headers.get("Authorization")):
            resp = json_error(401, "missing or invalid internal credential", type_="unauthorized")
            resp.headers["WWW-Authenticate"] = "Bearer"
            return resp
        return await handler(request)

    return check
