"""vLLM engine arguments that name a choice vllmini does not have, or another name for one it has.

Code and command lines written for vLLM pass these (``LLM(model, tensor_parallel_size=1,
enable_chunked_prefill=True)``, ``vllm serve --tokenizer-mode auto``): they are accepted at the
values that describe what vllmini does, and any other value is refused by name, with the reason,
rather than ignored. ``EngineArgs`` inherits them (keyword-only, after its own fields).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# vLLM's kernel-specific names for a checkpoint's method (they pick its kernels; vllmini dequantizes either way)
QUANTIZATION_ALIASES = {"gptq_marlin": "gptq", "auto_gptq": "gptq", "awq_marlin": "awq", "auto_awq": "awq"}
# name -> (accepted values, what vllmini does instead of the others)
FIXED = {
    "tensor_parallel_size": ((1,), "vllmini runs a model on one device"),
    "pipeline_parallel_size": ((1,), "vllmini runs a model on one device"),
    "data_parallel_size": ((1,), "an engine is one process on one device (run several servers behind a load balancer)"),
    "enable_chunked_prefill": ((True,), "vllmini always splits a prompt longer than max_num_batched_tokens into chunks"),
    "quantization": ((None, "fp8", "compressed-tensors", "modelopt", "modelopt_fp4", "mxfp4", "gptq", "awq", *QUANTIZATION_ALIASES),
                     "nothing is quantized online: a checkpoint's own FP8, GPTQ, AWQ, int8, NVFP4 or MXFP4 weights (and "
                     "a GGUF file's) are dequantized to the engine's dtype while loading"),
    "calculate_kv_scales": ((False,), "K/V are cached unscaled (scale 1.0, vLLM's default), saturated at fp8's range"),
    "tokenizer_mode": (("auto", "hf"), "tokenizers are transformers' (AutoTokenizer)"),
    "load_format": (("auto", "safetensors", "gguf"), "weights load from safetensors or GGUF files only"),
    "cpu_offload_gb": ((0,), "every weight stays on the engine's device"),
}  # fmt: skip


@dataclass(kw_only=True)
class VllmEngineArgs:
    """The fields of ``FIXED`` at vLLM's defaults (where vLLM's would be refused here, vllmini's
    only value), ``skip_tokenizer_init`` (engine/skip_tokenizer.py: no tokenizer, token ids in and
    out), ``enable_sleep_mode`` (``sleep`` / ``wake_up``: engine/worker.py), and
    ``kv_cache_memory_bytes``, vLLM's name for ``EngineArgs.kv_cache_memory``."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_chunked_prefill: bool = True
    quantization: str | None = None
    calculate_kv_scales: bool = False
    tokenizer_mode: str = "auto"
    load_format: str = "auto"
    cpu_offload_gb: float = 0
    enable_sleep_mode: bool = False
    skip_tokenizer_init: bool = False
    kv_cache_memory_bytes: int | None = None

    def check_vllm_args(self) -> None:
        """A ValueError naming the first field set to a value vllmini cannot honour."""
        for name, (accepted, reason) in FIXED.items():
            value = getattr(self, name)
            if not any(_same(value, ok) for ok in accepted):
                shown = " or ".join(repr(ok) for ok in accepted)
                raise ValueError(f"{name}={value!r} is not supported: {reason} (accepted: {shown})")


def resolve_kv_cache_memory(kv_cache_memory: int | None, kv_cache_memory_bytes: int | None) -> int | None:
    """The one KV budget the two names give (the same number twice is fine; two numbers are not)."""
    if kv_cache_memory_bytes is None:
        return kv_cache_memory
    if kv_cache_memory is not None and kv_cache_memory != kv_cache_memory_bytes:
        raise ValueError(f"kv_cache_memory={kv_cache_memory} and kv_cache_memory_bytes={kv_cache_memory_bytes} "
                         "disagree; they are one setting (vLLM's name is kv_cache_memory_bytes): give one")  # fmt: skip
    return kv_cache_memory_bytes


def _same(value: Any, accepted: Any) -> bool:
    """Equal, with True not taken for 1 (nor None for anything else)."""
    if isinstance(value, bool) or isinstance(accepted, bool) or value is None or accepted is None:
        return value is accepted
    return value == accepted


def parse_json_dict(name: str, value: dict | str | None, keys: str) -> dict[str, Any]:
    """An EngineArgs field that maps ``keys`` (named in the error) to values, as a dict: a dict,
    or its JSON text (the CLI's); None is {}."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"{name} must be a JSON object, got {value!r}: {exc}") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) and k for k in value):
        raise ValueError(f"{name} must map {keys} to values, got {value!r}")
    return value


def parse_hf_overrides(value: dict | str | None) -> dict[str, Any]:
    """``EngineArgs.hf_overrides`` as a dict: a dict, or its JSON text (the CLI's)."""
    return parse_json_dict("hf_overrides", value, "config.json field names")


def apply_hf_overrides(config: Any, overrides: dict | str | None) -> Any:
    """vLLM's ``hf_overrides``: set these fields of the model's transformers config before the model is
    built from it; a field holding a dict (``rope_scaling``) is updated key by key, not replaced."""
    for name, value in parse_hf_overrides(overrides).items():
        current = getattr(config, name, None)
        setattr(config, name, {**current, **value} if isinstance(current, dict) and isinstance(value, dict) else value)
    return config
