"""Helpers for tests that time something in a process holding the whole suite's heap."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_held_off() -> Iterator[None]:
    """No garbage collection inside the block: a full collection of the suite's heap holds the
    GIL for 0.1-0.3 s whatever else runs (CI saw 0.26 s), which is not what a timing test
    measures. One runs first, so the block starts with little to collect."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
