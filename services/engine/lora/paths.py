"""Keeping runtime adapter loads inside the configured adapter roots.

A runtime load names a path a client sent. ``AdapterRoots.resolve`` accepts it only if it
stays inside one of the roots after every symlink is followed: no ``..`` component at all
(even one that would stay inside), and the real path of the directory, and later of each file
read from it (``confine``), under the real path of a root. Resolving reads only link targets
and directory entries (``os.path.realpath``); no file outside the roots is ever opened. A
relative path is taken relative to the first root. Any refusal is a ``BadRequest`` naming
``lora_path``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from services.protocol.wire import BadRequest

PARAM = "lora_path"


class AdapterRoots:
    def __init__(self, roots: Sequence[str]) -> None:
        self.roots = tuple(Path(os.path.realpath(r)) for r in roots)

    def __bool__(self) -> bool:
        return bool(self.roots)

    def resolve(self, path: str) -> Path:
        """The adapter directory ``path`` names, resolved and confined to the roots."""
        if not self.roots:
            raise BadRequest("runtime adapter loading needs adapter roots: start the engine "
                             "with --lora-roots DIR", PARAM)
        if not isinstance(path, str) or not path or "\x00" in path:
            raise BadRequest("lora_path must be a non-empty path", PARAM)
        if ".." in PurePosixPath(path).parts:
            raise BadRequest(f"lora_path must not contain '..': {path!r}", PARAM)
        given = Path(path)
        candidate = given if given.is_absolute() else self.roots[0] / given
        return self.confine(candidate, shown=path)

    def confine(self, path: Path, shown: str | None = None) -> Path:
        """``path``'s real path if it lies inside a root, else a ``BadRequest``."""
        real = Path(os.path.realpath(path))
        if not any(real == root or root in real.parents for root in self.roots):
            raise BadRequest(
                f"lora_path {shown or str(path)!r} is outside the adapter roots", PARAM)
        return real
