"""FP8 checkpoints: weights stored as 8-bit floats with scales, dequantized while loading (as
vllmini does MXFP4 and GGUF weights) so the model computes in the engine's dtype.

Two formats, as vLLM reads them (the checkpoint's ``quantization_config``):
- ``quant_method: "fp8"`` (Qwen3's and DeepSeek's ``-FP8`` releases): with ``weight_block_size
  [bn, bk]`` each ``bn x bk`` tile of ``<name>`` shares one float32 in ``<name>_scale_inv``
  (``[ceil(N / bn), ceil(K / bk)]``, multiplied in despite its name); without it, one
  ``<name>_scale`` per tensor;
- ``quant_method: "compressed-tensors"`` with float8 weights (``-FP8-dynamic`` / ``-FP8`` exports of
  llm-compressor): ``<name>_scale`` per tensor (``[1]``), per output channel (``[N, 1]``) or per block;
- NVIDIA ModelOpt's (``quant_method: "modelopt"``, or hf_quant_config.json: quant_config.py) ``quant_algo``
  "FP8" (one ``weight_scale`` per tensor), "FP8_PER_CHANNEL_PER_TOKEN" (one per row) and "FP8_PB_WO"
  (128 x 128 tiles, as vLLM 0.32's modelopt.py reads them).

The dense weight is ``fp8 value * scale`` in float32, which is transformers' dequantization
(``FineGrainedFP8Config(dequantize=True)``). Activation scales (``input_scale``) and KV scales are
dropped: vllmini quantizes neither the activations nor (unless asked, unscaled) the KV cache, so a
dequantized model computes what the FP8 one approximates. Modules the export left unquantized
(``lm_head``, norms, a router) are plain float tensors and pass through.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from vllmini.models.quant_config import modelopt_settings, quantization_config

logger = logging.getLogger(__name__)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIXES = ("_scale_inv", "_scale")  # (the longer first: "_scale" ends "_scale_inv"'s stem)
DROPPED_SUFFIXES = ("input_scale", "output_scale", "k_scale", "v_scale", "q_scale", "prob_scale")
# ModelOpt's FP8 quant_algo -> its weights' scale tiles (None: per tensor or per row); "FP8_BLOCK_SCALES":
# early exports' name for "FP8_PB_WO" (vLLM keeps it as an alias)
MODELOPT_FP8_ALGOS = {"FP8": None, "FP8_PER_CHANNEL_PER_TOKEN": None, "FP8_PB_WO": (128, 128), "FP8_BLOCK_SCALES": (128, 128)}


@dataclass(frozen=True)
class Fp8Format:
    """What a checkpoint's ``quantization_config`` says of its FP8 weights."""

    method: str  # "fp8", "compressed-tensors" or "modelopt"
    block: tuple[int, int] | None  # a scale tile's [rows, columns]; None: per-tensor or per-channel scales


def fp8_format(config: Any) -> Fp8Format | None:
    """The FP8 format of a model's config (transformers' object or config.json as a dict); None when
    its weights are not FP8. A quantization this module cannot read raises, naming it."""
    quant = quantization_config(config)
    if quant is None:
        return None
    method = quant.get("quant_method")
    if method == "fp8":
        return Fp8Format("fp8", _block(quant.get("weight_block_size"), "weight_block_size"))
    if method == "modelopt":
        algo = modelopt_settings(quant)[0]
        return Fp8Format("modelopt", MODELOPT_FP8_ALGOS[algo]) if algo in MODELOPT_FP8_ALGOS else None
    if method != "compressed-tensors":
        return None
    groups = quant.get("config_groups") or {}
    weights = [((g or {}).get("weights") or {}) for g in groups.values()]
    if weights and (all(w.get("type") == "int" for w in weights) or quant.get("format") == "nvfp4-pack-quantized"
                    or all(w.get("type") == "float" and w.get("num_bits") == 4 for w in weights)):  # fmt: skip
        return None  # (int weights: models/gptq_awq.py, models/int8.py; FP4 ones: models/nvfp4.py)
    blocks = set()
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ValueError(f"quantization_config.config_groups.{name}.weights is {weights.get('type')!r} with "
                             f"{weights.get('num_bits')!r} bits; vllmini reads compressed-tensors' float8 and (packed) int weights, one kind "
                             "per checkpoint")  # fmt: skip
        if weights.get("strategy") == "block":
            blocks.add(_block(weights.get("block_structure"), f"config_groups.{name}.weights.block_structure"))
    if not groups or len(blocks) > 1:
        raise ValueError("quantization_config (compressed-tensors) needs one or more config_groups of float8 weights "
                         f"with one block structure (got {len(groups)} groups, blocks {sorted(blocks)})")  # fmt: skip
    return Fp8Format("compressed-tensors", blocks.pop() if blocks else None)


def _block(value: Any, field: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):  # fmt: skip
        raise ValueError(f"quantization_config.{field} must be two positive integers, got {value!r}")
    return int(value[0]), int(value[1])


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                   name: str = "weight") -> torch.Tensor:  # fmt: skip
    """``weight [..., N, K]`` (float8) times its ``scale`` -> float32: one scale for the tensor,
    one per row (``[..., N, 1]``), or one per ``block`` tile (``[..., ceil(N / bn), ceil(K / bk)]``)."""
    if weight.dim() < 2:
        raise ValueError(f"FP8 tensor {name!r} has shape {tuple(weight.shape)}; a quantized weight has two or more dimensions")
    *lead, n, k = weight.shape
    dense = weight.to(torch.float32)
    scale = scale.to(torch.float32)
    if scale.numel() == 1:
        return dense.mul_(scale.reshape(()))
    if tuple(scale.shape) == (*lead, n, 1) or (not lead and tuple(scale.shape) == (n,)):
        return dense.mul_(scale.reshape(*lead, n, 1))
    if block is not None:
        bn, bk = block
        tiles = (*lead, -(-n // bn), -(-k // bk))
        if tuple(scale.shape) == tiles:
            if n % bn == 0 and k % bk == 0:  # (whole tiles: a broadcast view, ~1.7x the expanded scale's speed)
                tiled = dense.view(*lead, n // bn, bn, k // bk, bk)
                return tiled.mul_(scale.unsqueeze(-1).unsqueeze(-3)).view(weight.shape)
            full = scale.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
            return dense.mul_(full)
    raise ValueError(f"FP8 tensor {name!r} {tuple(weight.shape)} has a scale of shape {tuple(scale.shape)}: expected one "
                     f"value, one per row {(*lead, n, 1)}" + (f" or one per {block[0]}x{block[1]} tile" if block else ""))  # fmt: skip


def dequantize_fp8_weights(weights: Iterator[tuple[str, torch.Tensor]], fmt: Fp8Format) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) pairs with each FP8 tensor dequantized (float32) and its scale
    consumed; activation and KV scales are dropped. A weight and its scale may come in either order,
    from different shards; one left without the other is an error naming it."""
    weights_waiting: dict[str, torch.Tensor] = {}  # FP8 tensors whose scale has not come yet
    scales_waiting: dict[str, torch.Tensor] = {}  # scales by their weight's name
    dropped = 0
    for name, tensor in weights:
        if name.rsplit(".", 1)[-1] in DROPPED_SUFFIXES:
            dropped += 1
            continue
        owner = next((name[: -len(s)] for s in SCALE_SUFFIXES if name.endswith(s)), None)
        if owner is not None:
            if owner in weights_waiting:
                yield owner, dequantize_fp8(weights_waiting.pop(owner), tensor, fmt.block, owner)
            else:
                scales_waiting[owner] = tensor
        elif tensor.dtype in FP8_DTYPES:
            if name in scales_waiting:
                yield name, dequantize_fp8(tensor, scales_waiting.pop(name), fmt.block, name)
            else:
                weights_waiting[name] = tensor
        else:
            yield name, tensor
    if weights_waiting or scales_waiting:
        lone = [f"{n} (no scale)" for n in weights_waiting] + [f"{n}'s scale (no FP8 tensor {n})" for n in scales_waiting]
        raise ValueError(f"FP8 checkpoint: {', '.join(sorted(lone)[:5])}" + (f", ... ({len(lone)} in all)" if len(lone) > 5 else ""))
    if dropped:
        logger.info("FP8 checkpoint: %d activation/KV scale tensors dropped (vllmini computes in the engine's dtype)", dropped)
