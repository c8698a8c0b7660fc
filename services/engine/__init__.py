"""Pagoda's engine: continuous batching, PagedAttention, automatic prefix caching."""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]

if TYPE_CHECKING:
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine
    from services.engine.llm import LLM
    from services.engine.outputs import RequestOutput
    from services.protocol.sampling_params import SamplingParams
    from services.protocol.structured_outputs import StructuredOutputsParams


def __getattr__(name: str):
    # Lazy, so `import services.engine.block_manager` does not load torch and the model code.
    if name == "LLM":
        from services.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from services.protocol.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from services.protocol.structured_outputs import StructuredOutputsParams

        return StructuredOutputsParams
    if name == "EngineConfig":
        from services.engine.config import EngineConfig

        return EngineConfig
    if name == "LLMEngine":
        from services.engine.engine import LLMEngine

        return LLMEngine
    if name == "RequestOutput":
        from services.engine.outputs import RequestOutput

        return RequestOutput
    raise AttributeError(name)
