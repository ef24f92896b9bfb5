"""Checks on an HF-format model folder, for what users really hand over: a config.json with a
zero, a negative or a missing size, a quantized checkpoint vllmini cannot read, integer tensors,
one tensor in two shard files. Each becomes one error naming the file, instead of a ZeroDivisionError
inside transformers, a negative dimension inside torch, silently wrong weights, or a shape
mismatch that blames config.json for a size it never set (transformers' default filled it in).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from vllmini.models.fp8 import FP8_DTYPES, fp8_format
from vllmini.models.gptq_awq import INTEGER_PART_SUFFIXES, wna16_format
from vllmini.models.int8 import int_format, is_int_part
from vllmini.models.mxfp4 import MXFP4_SUFFIXES, is_mxfp4
from vllmini.models.nvfp4 import MODELOPT_NVFP4_ALGOS, is_nvfp4_part, nvfp4_format
from vllmini.models.quant_config import HF_QUANT_CONFIG, modelopt_settings, quantization_config
from vllmini.vllm_args import QUANTIZATION_ALIASES

MXFP4_ARCHITECTURE = "GptOssForCausalLM"  # the one architecture whose MXFP4 checkpoints are read

# sizes every supported architecture's config has, at least 1 when set
_SIZE_KEYS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "num_key_value_heads",
              "head_dim")  # fmt: skip
# sizes whose transformers default is a fixed number (Llama 2 7B's), not derived from the others
_DEFAULTED_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                   "num_hidden_layers", "vocab_size")  # fmt: skip
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_config(config: Any, raw: dict, path: Path) -> None:
    """``config`` (transformers' reading of ``path``, whose JSON is ``raw``) describes a model of
    float weights with positive sizes."""
    quant, where = raw.get("quantization_config"), path
    if quant is None and (path.parent / HF_QUANT_CONFIG).is_file():  # (ModelOpt's older exports: quant_config.py)
        quant, where = quantization_config(raw, path.parent), path.parent / HF_QUANT_CONFIG
    described = {"quantization_config": quant}
    if is_mxfp4(raw) and MXFP4_ARCHITECTURE in (raw.get("architectures") or []):
        pass  # (gpt-oss's experts: dequantized while loading, models/mxfp4.py)
    elif quant is not None:
        try:  # (FP8, GPTQ, AWQ, int8 and NVFP4 weights: dequantized while loading, models/fp8.py, gptq_awq.py, int8.py, nvfp4.py)
            readable = nvfp4_format(described) or fp8_format(described) or wna16_format(described) or int_format(described)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if readable is None:
            method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else quant
            raise ValueError(f"{where}: a quantized checkpoint (quantization_config with quant_method {method!r}); vllmini "
                             "loads float weights, FP8 ones ('fp8', compressed-tensors' float8, ModelOpt's), GPTQ, AWQ, "
                             "compressed-tensors' int and NVFP4, ModelOpt's NVFP4 and gpt-oss's MXFP4 experts: use the "
                             "model's unquantized checkpoint, or a GGUF file of it")  # fmt: skip
    for key in _SIZE_KEYS:
        value = getattr(config, key, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{path}: {key} is {value!r}; it must be a positive integer")


def check_quantization(requested: str | None, config: Any, model_dir: Path) -> None:
    """vLLM's ``quantization`` names the checkpoint's own method, if given (vllmini reads that from
    config.json and does not quantize an unquantized checkpoint online)."""
    quant = quantization_config(config, model_dir) or {}
    found = quant.get("quant_method")
    says = f"quant_method {found!r}" if found else "the weights are not quantized"
    names = {found}
    if found == "modelopt":  # (vLLM resolves ModelOpt's NVFP4 to "modelopt_fp4"; its FP8 stays "modelopt")
        algo = modelopt_settings(quant)[0]
        says += f" with quant_algo {algo!r}"
        names |= {"modelopt_fp4"} if algo in MODELOPT_NVFP4_ALGOS else set()
    if requested is not None and QUANTIZATION_ALIASES.get(requested, requested) not in names:
        where = model_dir / ("config.json" if quantization_config(config) is not None or not quant else HF_QUANT_CONFIG)
        raise ValueError(f"quantization={requested!r}, but {where} says {says}; vllmini does not quantize online: "
                         "leave quantization unset (a checkpoint's own method is read from it)")  # fmt: skip


def check_tensor(path: Path, name: str, tensor: torch.Tensor, quant: str | None = None) -> None:
    """A checkpoint tensor holds floating-point values of a dtype the models compute in (an integer
    tensor copied into a float parameter loads silently, and wrongly: a quantized checkpoint's
    packed weights, or a broken export). ``quant``: the checkpoint's quantization whose packed tensors
    are dequantized while loading: "mxfp4" (gpt-oss's ``*_blocks`` / ``*_scales`` bytes), "fp8"
    (float8 tensors, models/fp8.py), "wna16" (GPTQ / AWQ int32 words, models/gptq_awq.py), "int8"
    (compressed-tensors' int8 weights and zero points, models/int8.py), "nvfp4" (packed uint8 weights and
    float8 group scales, models/nvfp4.py)."""
    if ((quant == "mxfp4" and tensor.dtype == torch.uint8 and name.endswith(MXFP4_SUFFIXES))
            or (quant == "fp8" and tensor.dtype in FP8_DTYPES)
            or (quant == "wna16" and tensor.dtype in (torch.int32, torch.int64) and name.endswith(INTEGER_PART_SUFFIXES))
            or (quant == "int8" and is_int_part(name, tensor)) or (quant == "nvfp4" and is_nvfp4_part(name, tensor))):  # fmt: skip
        return
    if tensor.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"{path}: tensor {name!r} holds {str(tensor.dtype).removeprefix('torch.')} values; vllmini "
                         "loads float32, bfloat16 or float16 weights (integer or float8 tensors are a quantized "
                         "checkpoint's: use the model's unquantized checkpoint, or a GGUF file of it)")  # fmt: skip


def unset_sizes(model_dir: Path, config: Any) -> str:
    """A note for an error about shapes: the sizes config.json leaves to transformers' defaults
    (a hand-written config without ``hidden_size`` gets 4096), with the values used; "" if none."""
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    # (a key the config class derives from others, as Nemotron-H's num_hidden_layers, is no default)
    unset = [f"{key} (default {getattr(config, key)})" for key in _DEFAULTED_KEYS
             if isinstance(raw, dict) and key not in raw and getattr(config, key, None) is not None
             and not isinstance(getattr(type(config), key, None), property)]  # fmt: skip
    return f" (config.json does not set {', '.join(unset)}: transformers' defaults were used)" if unset else ""
