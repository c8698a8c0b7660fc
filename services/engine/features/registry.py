"""Where the runner finds the step features that parts above the core implement.

Such a part (``spec_decode``: its verifier reads the input batch, the sampler's stages and the
scheduler's output) imports the core, or the core imports it for its public API, so the core
cannot name it here: it registers a maker (``register``), and the runner asks for the enabled
features' factories (``factories``) without naming any of them. A part provides features by
holding a module named ``feature`` (``PROVIDER_MODULE``); every such module of the engine's
parts is imported on first use, as Django imports each app's ``admin`` module: adding a
feature adds its part's module, never a line here.

A maker takes the runner (its config, device, rank, model) once the model is loaded and
returns a ``FeatureFactory`` when its feature is enabled (None otherwise); the factory builds
the features that change the model before its weights are packed, says what the others need
before the KV pool is sized, and builds them after (``protocol``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.engine.features.protocol import FeatureFactory

# The module of an engine part that registers its step features (see the module docstring).
PROVIDER_MODULE = "feature"
_ENGINE = Path(__file__).resolve().parents[1]

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
        for module in providers(PROVIDER_MODULE):
            importlib.import_module(module)
        _loaded = True
    return dict(_makers)


def providers(module: str) -> list[str]:
    """The dotted names of the engine parts' modules named ``module``, by part name (a part
    is a package of ``services.engine``)."""
    return [f"services.engine.{path.parent.name}.{module}"
            for path in sorted(_ENGINE.glob(f"*/{module}.py"))
            if (path.parent / "__init__.py").is_file()]


def factories(runner: Any) -> list[FeatureFactory]:
    """The enabled features' factories for ``runner`` (see the module docstring)."""
    out = []
    for make in makers().values():
        factory = make(runner)
        if factory is not None:
            out.append(factory)
    return out
