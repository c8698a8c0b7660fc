"""``--speculative-config``'s object, as this package names it. It lives with the engine's
other flags (``services.engine.config``: the public surface, as vLLM's ``SpeculativeConfig``
lives in its config), which the core reads without importing this package."""

from services.engine.config import SpecMethod, SpeculativeConfig, check_draft_matches

__all__ = ["SpecMethod", "SpeculativeConfig", "check_draft_matches"]
