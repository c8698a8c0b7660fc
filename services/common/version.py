"""Pagoda's own version, as installed (``0+unknown`` when run from a source tree)."""

from __future__ import annotations

import importlib.metadata


def package_version() -> str:
    try:
        return importlib.metadata.version("pagoda")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "0+unknown"
