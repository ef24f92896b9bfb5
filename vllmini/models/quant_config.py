"""A model config's ``quantization_config``, read one way for every quantized format (models/fp8.py,
models/gptq_awq.py, models/mxfp4.py) and for vLLM's ``quantization`` argument."""
from __future__ import annotations

from typing import Any


def quantization_config(config: Any) -> dict | None:
    """``config``'s ``quantization_config`` as a dict: from config.json's dict or transformers' config
    (where it may be a quantization-config object); None when there is none, or it is no mapping."""
    quant = config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config", None)
    if hasattr(quant, "to_dict"):
        quant = quant.to_dict()
    return quant if isinstance(quant, dict) else None
