"""Child processes that never outlive the one that started them."""

from __future__ import annotations

import ctypes
import logging
import signal

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGKILL this process when the thread that started it ends (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        logger.warning("PR_SET_PDEATHSIG unavailable: this process may outlive its parent")
