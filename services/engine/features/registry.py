"""Where the runner finds the step features that parts above the core implement.

Such a part (``spec_decode``: its verifier reads the input batch, the sampler's stages and the
scheduler's output) imports the core, so the core cannot import it: it registers a maker here
(``register``), and the runner asks for the enabled features' factories (``factories``) without
naming any of them. The parts are found by module name (``PROVIDERS``), imported on first use,
as vLLM's model registry names its model classes' modules and the core names its workers'
entry module: a name here is the one place a provider is listed.

A maker takes the runner (its config, device, rank, model) once the model is loaded and
returns a ``FeatureFactory`` when its feature is enabled (None otherwise); the factory says
what the feature needs before the KV pool is sized, and builds it after (``protocol``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from services.engine.features.protocol import FeatureFactory

# The modules that register step features, imported by name on first use.
PROVIDERS: tuple[str, ...] = ("services.engine.spec_decode.feature",)

Maker = Callable[[Any], FeatureFactory | None]  # (the runner) -> its factory, or None: off

_makers: dict[str, Maker] = {}
_loaded = False


def register(name: str, maker: Maker) -> None:
    """A part's feature, by its name (``StepFeature.name``); registering a name again replaces
    its maker (a module reloaded)."""
    _makers[name] = maker


def makers() -> dict[str, Maker]:
    """Every registered maker, by feature name, in registration order (the providers'
    modules imported first)."""
    global _loaded
    if not _loaded:
        for module in PROVIDERS:
            importlib.import_module(module)
        _loaded = True
    return dict(_makers)


def factories(runner: Any) -> list[FeatureFactory]:
    """The enabled features' factories for ``runner`` (see the module docstring)."""
    out = []
    for make in makers().values():
        factory = make(runner)
        if factory is not None:
            out.append(factory)
    return out
