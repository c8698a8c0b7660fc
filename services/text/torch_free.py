"""The gateway and the router never run a model: they import transformers for its tokenizers
and chat templates only. transformers 5 imports torch whenever it can find it, which costs
each of those processes about 2 s of CPU at start and a few hundred MB of memory (every gateway
pod, every engine pod's OpenAI sidecar, every router). ``hide_torch`` makes torch unfindable in
this process before anything imports transformers, so it loads as tokenizers-only."""

from __future__ import annotations

import sys


def hide_torch() -> None:
    """Call first thing in a process that must never import torch; an import of torch after it
    raises ImportError instead of loading it."""
    assert "torch" not in sys.modules, "torch was imported before hide_torch()"
    # importlib.util.find_spec (transformers' availability test) answers None for a name
    # mapped to None in sys.modules, and `import torch` raises ModuleNotFoundError.
    sys.modules["torch"] = None  # type: ignore[assignment]
