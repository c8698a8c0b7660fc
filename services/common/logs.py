"""Logging set-up: the one way every process Pagoda starts configures its logs.

Every entry point (gateway, router, engine server, engine-core process, tensor-parallel worker,
``services.serve``, the batch job, the model converter) calls ``setup_logging`` once, first
thing, so that all of them write one line format to stderr:

    2026-12-01 10:00:00,123 INFO engine-core services.engine.engine: loaded model=...

The role says which process wrote the line: ``make serve`` interleaves the logs of a whole
stack on one terminal, and an engine's core process and its workers share the server's stderr.
What the services log never holds an API key, a prompt or an output
(tests/security/test_logs.py); that is the loggers' business, not this module's.
"""

from __future__ import annotations

import logging
import re

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_ROLE = re.compile(r"[A-Za-z0-9_.\-\[\] ]+")


def log_format(role: str) -> str:
    if not _ROLE.fullmatch(role):  # it becomes part of a %-format string
        raise ValueError(f"a log role is letters, digits and -_.[] only, got {role!r}")
    return f"%(asctime)s %(levelname)s {role} %(name)s: %(message)s"


def check_log_level(log_level: str) -> None:
    """A config's ``log_level`` field: a name from ``LOG_LEVELS``, any case."""
    if log_level.upper() not in LOG_LEVELS:
        raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}")


def setup_logging(level: str | int, role: str) -> None:
    """Configures this process's root logger: stderr, the one format, ``level`` (a name from
    ``LOG_LEVELS``, any case, or a ``logging`` number). Like ``logging.basicConfig``, whose
    one call this is, it leaves a root logger that already has handlers alone (an embedding
    application, pytest)."""
    if isinstance(level, str):
        check_log_level(level)
        level = level.upper()
    logging.basicConfig(level=level, format=log_format(role))
