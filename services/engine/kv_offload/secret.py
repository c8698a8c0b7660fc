"""The KV store's MAC key: a deployment secret every engine of the model shares.

Values in the shared store are authenticated with it (``block_value``): a value that anything
without it wrote (another deployment, a client of the store, a tampered entry) is a miss, never
used. There is no default and no per-process key: engines that each made up a key would fill
the store with values no other engine can use, and sharing is the store's only purpose. So an
engine given ``--kv-store-url`` without a secret refuses to start and says how to give one.

Read from ``--kv-store-secret-file`` (the chart mounts a Secret there) or else from
``$PAGODA_KV_STORE_SECRET``; the path is the operator's, not a client's, so symlinks are
followed (a Kubernetes Secret volume is made of them), but only a regular file of at most
``MAX_SECRET_FILE_BYTES`` is read, opened without blocking (a FIFO never hangs the start).
Surrounding whitespace is cut (a trailing newline is what editors leave). At least
``MIN_SECRET_BYTES`` bytes: a short secret is a mistake to refuse, not to use.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

SECRET_ENV = "PAGODA_KV_STORE_SECRET"
SECRET_FILE_FLAG = "--kv-store-secret-file"
MIN_SECRET_BYTES = 16
MAX_SECRET_FILE_BYTES = 4096


def load_store_secret(path: str | None, environ: Mapping[str, str] | None = None) -> bytes:
    """The secret from ``path``, else from ``$PAGODA_KV_STORE_SECRET``. Raises ValueError
    naming what is wrong (never the secret)."""
    if path is not None:
        return _checked(_read_file(path), f"{SECRET_FILE_FLAG} {path}")
    text = (os.environ if environ is None else environ).get(SECRET_ENV, "")
    if not text:
        raise ValueError(
            f"kv_store_url needs the KV store's MAC key (a secret shared by every engine of "
            f"the model, at least {MIN_SECRET_BYTES} bytes): {SECRET_FILE_FLAG} PATH or "
            f"${SECRET_ENV}; e.g. `openssl rand -hex 32`")
    return _checked(text.encode(), f"${SECRET_ENV}")


def _read_file(path: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"{SECRET_FILE_FLAG} {path}: cannot open it ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{SECRET_FILE_FLAG} {path}: not a regular file")
        if st.st_size > MAX_SECRET_FILE_BYTES:
            raise ValueError(f"{SECRET_FILE_FLAG} {path}: larger than {MAX_SECRET_FILE_BYTES} "
                             "bytes; a secret is a short line")
        return os.read(fd, MAX_SECRET_FILE_BYTES + 1)[:MAX_SECRET_FILE_BYTES]
    finally:
        os.close(fd)


def _checked(secret: bytes, source: str) -> bytes:
    secret = secret.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{source}: the KV store's MAC key must be at least "
                         f"{MIN_SECRET_BYTES} bytes, got {len(secret)}")
    return secret
