"""Where an adapter's files are, and opening that directory without leaving the roots.

A runtime load names a path a client sent. ``AdapterRoots.resolve`` maps it, by its text
alone (nothing is opened), onto an ``AdapterSource``: a root and the path's components below
it. No ``..`` component at all, an absolute path must begin with a root, a relative one is
taken relative to the first root. ``AdapterSource.open_dir`` then walks from the root's
descriptor one component at a time with ``O_NOFOLLOW | O_DIRECTORY``: a symlink anywhere
below the root is refused (whether it would stay inside or not), so no file outside the
roots is ever opened, whatever is renamed or relinked while the walk runs. The files in the
directory are opened relative to its descriptor (``peft``), also with ``O_NOFOLLOW``.

An operator's own paths (``--lora-modules``, the offline API) are ``AdapterSource.of``: opened
as given, symlinks followed (a Hugging Face cache links its files into blobs). Any refusal is a
``BadRequest`` naming ``lora_path``.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from services.protocol.wire import BadRequest

PARAM = "lora_path"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


@dataclass(frozen=True, slots=True)
class AdapterSource:
    """An adapter directory: ``base`` (opened as it is: a root, or an operator's own path),
    then ``parts`` below it, each opened with ``O_NOFOLLOW``; ``confined``: its files are
    opened with ``O_NOFOLLOW`` too."""

    shown: str  # the path as the caller gave it (replies, logs, heartbeats)
    base: str
    parts: tuple[str, ...] = ()
    confined: bool = False

    @classmethod
    def of(cls, path: str | Path) -> AdapterSource:
        """An operator's path, trusted: opened as given."""
        return cls(str(path), str(path))

    def open_dir(self) -> int:
        """A descriptor of the adapter directory (the caller closes it)."""
        try:
            fd = os.open(self.base, _DIR_FLAGS)
        except OSError as exc:
            raise _refused(self.shown, exc) from None
        for name in self.parts:
            try:
                child = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                raise _refused(self.shown, exc) from None
            finally:
                os.close(fd)
            fd = child
        return fd


class AdapterRoots:
    def __init__(self, roots: Sequence[str]) -> None:
        # Each root as configured and as its real path: a client may name either.
        self.roots = tuple(os.path.abspath(r) for r in roots)
        self._prefixes = [(PurePosixPath(p).parts, r) for r in self.roots
                          for p in {r, os.path.realpath(r)}]

    def __bool__(self) -> bool:
        return bool(self.roots)

    def resolve(self, path: str) -> AdapterSource:
        """The adapter directory ``path`` names, as a root and components below it (by its
        text only: nothing is opened here)."""
        if not self.roots:
            raise BadRequest("runtime adapter loading needs adapter roots: start the engine "
                             "with --lora-roots DIR", PARAM)
        if not isinstance(path, str) or not path or "\x00" in path:
            raise BadRequest("lora_path must be a non-empty path", PARAM)
        parts = PurePosixPath(path).parts  # "." and repeated "/" dropped
        if ".." in parts:
            raise BadRequest(f"lora_path must not contain '..': {path!r}", PARAM)
        if not PurePosixPath(path).is_absolute():
            return AdapterSource(path, self.roots[0], parts, confined=True)
        for prefix, root in self._prefixes:
            if parts[: len(prefix)] == prefix:
                return AdapterSource(path, root, parts[len(prefix):], confined=True)
        raise BadRequest(f"lora_path {path!r} is outside the adapter roots", PARAM)


def _refused(shown: str, exc: OSError) -> BadRequest:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        why = "is not a directory, or passes through a symbolic link (links below the " \
              "adapter roots are not followed)"
    elif exc.errno == errno.ENOENT:
        why = "does not exist on this engine"
    else:
        why = f"cannot be opened ({exc.strerror})"
    return BadRequest(f"lora_path {shown!r} {why}", PARAM)
