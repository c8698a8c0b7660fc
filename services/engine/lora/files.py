"""Reading one adapter file as an attacker's file: relative to its directory's descriptor,
regular files only, size-capped, with a deadline.

``read_file`` opens with ``O_NONBLOCK`` (a FIFO then opens at once instead of waiting for a
writer; a regular file ignores the flag) and, for a confined source, ``O_NOFOLLOW``; ``fstat``
on the open descriptor decides (a FIFO, a device such as ``/dev/zero``, a socket or a directory
is refused, and so is a file above the cap, before a byte is read). The read goes in chunks
into one buffer of the size ``fstat`` gave, checking the deadline between chunks; a file that
grows meanwhile is read only to that size (its digest and validation then judge it). Runs on
the loader thread, never the engine's.
"""

from __future__ import annotations

import errno
import os
import stat
import time

from services.engine.lora.paths import PARAM
from services.protocol.wire import BadRequest

READ_DEADLINE_S = 60.0  # one adapter's files; a healthy disk reads 100 MB in well under 1 s
_CHUNK = 8 << 20


class LoadTimeout(TimeoutError):
    """The files did not arrive before the deadline (the storage's fault: a 504)."""


def read_file(dir_fd: int, name: str, max_bytes: int, deadline: float, confined: bool
              ) -> bytearray:
    """The bytes of ``name`` in the directory ``dir_fd``; ``deadline``: ``time.monotonic()``."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_NOFOLLOW if confined else 0)
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        why = "is a symbolic link (not followed below the adapter roots)" \
            if exc.errno == errno.ELOOP else f"cannot be opened ({exc.strerror})"
        raise BadRequest(f"the adapter's {name} {why}", PARAM) from None
    with os.fdopen(fd, "rb", buffering=0) as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise BadRequest(f"the adapter's {name} is not a regular file", PARAM)
        if info.st_size > max_bytes:
            raise BadRequest(f"the adapter's {name} is {info.st_size} bytes, above this "
                             f"engine's limit of {max_bytes} (--max-lora-file-bytes)", PARAM)
        return _read_until(f, info.st_size, deadline, name)


def _read_until(f, size: int, deadline: float, name: str) -> bytearray:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        if time.monotonic() > deadline:
            raise LoadTimeout(f"reading the adapter's {name} took longer than "
                              f"{READ_DEADLINE_S:g} s")
        n = f.readinto(view[got : got + _CHUNK])
        if not n:  # shrank since fstat: what is there is judged by its parser
            del view
            del buf[got:]
            return buf
        got += n
    return buf
