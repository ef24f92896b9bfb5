"""vllmini: a small, readable LLM inference engine (paged KV cache, continuous batching)."""
from __future__ import annotations

import logging
import os


def _configure_logging() -> None:
    """Like vLLM, say what the engine is doing (model load, KV cache size) by default;
    VLLMINI_LOGGING_LEVEL=WARNING quiets it, VLLMINI_CONFIGURE_LOGGING=0 leaves logging alone."""
    if os.environ.get("VLLMINI_CONFIGURE_LOGGING", "1") == "0":
        return
    logger = logging.getLogger("vllmini")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s vllmini: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(os.environ.get("VLLMINI_LOGGING_LEVEL", "INFO").upper())


_configure_logging()

from vllmini.config import AsyncEngineArgs, EngineArgs, PoolerConfig
from vllmini.engine.async_engine import AsyncLLMEngine, EngineDeadError
from vllmini.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from vllmini.engine.llm import LLM
from vllmini.engine.llm_engine import LLMEngine
from vllmini.engine.outputs import (ClassificationOutput, ClassificationRequestOutput, CompletionOutput, EmbeddingOutput,
                                    EmbeddingRequestOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestMetrics,
                                    RequestOutput, ScoringOutput, ScoringRequestOutput)  # fmt: skip
from vllmini.engine.pooling_params import PoolingParams
from vllmini.engine.repetition_detection import RepetitionDetectionParams
from vllmini.engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from vllmini.lora.request import LoRARequest

__all__ = [
    "LLM",
    "AsyncLLMEngine",
    "LLMEngine",
    "EngineArgs",
    "AsyncEngineArgs",
    "SamplingParams",
    "StructuredOutputsParams",
    "RepetitionDetectionParams",
    "LoRARequest",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "RequestMetrics",
    "RequestOutputKind",
    "EngineDeadError",
    "PoolingParams",
    "PoolerConfig",
    "PoolingOutput",
    "PoolingRequestOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
]
__version__ = "0.1.0"
