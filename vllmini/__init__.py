"""vllmini: a small, readable LLM inference engine (paged KV cache, continuous batching)."""
from __future__ import annotations

from vllmini.config import EngineArgs
from vllmini.engine.llm import LLM
from vllmini.engine.llm_engine import LLMEngine
from vllmini.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from vllmini.engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineArgs",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
]
__version__ = "0.1.0"
