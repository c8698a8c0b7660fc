"""Records the per-call work a model's layers must not do: imports and device checks.

``per_layer_work()`` is a context manager yielding a list; while it is open, every ``import``
statement executed by the engine's model, kernel or CPU-kernel code is appended to it, and so is
every read of a tensor's ``is_cuda``/``is_cpu``/``device`` made from that code, and every call
of ``torch.cuda.is_available``/``is_current_stream_capturing``. Layers choose their kernels once
when the model is loaded, so a forward pass should leave the list empty (except for ``device``
reads that allocate on the device path, which callers may allow by module).
"""

from __future__ import annotations

import builtins
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

_WATCHED = ("services.engine.models", "services.engine.kernels", "services.engine.cpu_ops")


def _watched(module_globals: dict | None) -> str | None:
    name = (module_globals or {}).get("__name__", "")
    return name if name.startswith(_WATCHED) else None


@contextmanager
def per_layer_work() -> Iterator[list[str]]:
    seen: list[str] = []
    real_import = builtins.__import__

    def recording_import(name, globals=None, locals=None, fromlist=(), level=0):
        where = _watched(globals)
        if where:
            seen.append(f"import {name} in {where}")
        return real_import(name, globals, locals, fromlist, level)

    def recording_property(attr: str) -> property:
        real = getattr(torch._C.TensorBase, attr)

        def get(tensor: torch.Tensor):
            where = _watched(sys._getframe(1).f_globals)
            if where:
                seen.append(f"tensor.{attr} in {where}")
            return real.__get__(tensor)

        return property(get)

    def recording_call(name: str, real):
        def call(*args, **kwargs):
            where = _watched(sys._getframe(1).f_globals)
            if where:
                seen.append(f"torch.cuda.{name}() in {where}")
            return real(*args, **kwargs)

        return call

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(builtins, "__import__", recording_import)
        for attr in ("is_cuda", "is_cpu", "device"):
            patch.setattr(torch.Tensor, attr, recording_property(attr))
        for name in ("is_available", "is_current_stream_capturing"):
            patch.setattr(torch.cuda, name, recording_call(name, getattr(torch.cuda, name)))
        yield seen
