"""NVFP4 checkpoints (4-bit E2M1 floats in groups of 16 along the inputs, each group's scale an FP8
E4M3 value, times one float32 scale per tensor), dequantized while loading as models/mxfp4.py does
gpt-oss's MXFP4 experts, so the model computes in the engine's dtype. Two producers, as vLLM 0.32 reads them:

- compressed-tensors' ``nvfp4-pack-quantized`` (llm-compressor's ``NVFP4`` / ``NVFP4A16`` schemes):
  ``<m>.weight_packed [N, K / 2]`` (uint8, two values a byte, the low nibble first),
  ``<m>.weight_scale [N, K / 16]`` (float8_e4m3fn), ``<m>.weight_global_scale [1]`` (float32); the
  global scale *divides*: the dense weight is ``e2m1 * (weight_scale / weight_global_scale)``, as
  compressed-tensors' ``dequantize`` computes it (vLLM multiplies by its reciprocal);
- NVIDIA ModelOpt's ``quant_algo: "NVFP4"`` (``quant_method: "modelopt"`` in config.json, or an
  hf_quant_config.json: quant_config.py): ``<m>.weight [N, K / 2]`` (uint8), ``<m>.weight_scale``
  (float8, ``[N, K / group_size]``, 16 by default), ``<m>.weight_scale_2`` (float32, one value) that
  *multiplies*: ``e2m1 * (weight_scale * weight_scale_2)``, as vLLM's ``dequantize_to_dtype``.

Each product is exact in float32 (a 2-bit-mantissa value times an 8-bit-mantissa scale, the scale
product rounded once), then rounded once to the engine's dtype. The activations' quantization
(``input_scale``, ``input_global_scale``: W4A4) and KV scales are dropped; excluded layers (``ignore`` /
``exclude_modules``: ``lm_head``, a router) are float tensors and pass as they come.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

from vllmini.models.fp8 import DROPPED_SUFFIXES, MODELOPT_FP8_ALGOS
from vllmini.models.mxfp4 import E2M1_VALUES
from vllmini.models.quant_config import gather_parts, modelopt_settings, quantization_config

NVFP4_FORMAT = "nvfp4-pack-quantized"
MODELOPT_NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")  # (W4A16_NVFP4: the same weights, 16-bit activations)
# each byte's two values, the low nibble first (E2M1: sign bit 3, then two exponent bits and one mantissa bit)
# (each pair as one int64 word: one 8-byte gather per byte, by int32 indices, ~1.5x a float32 [256, 2] table's)
_PAIRS = torch.tensor([[E2M1_VALUES[b & 0x0F], E2M1_VALUES[b >> 4]] for b in range(256)], dtype=torch.float32)
_PAIR_WORDS = _PAIRS.view(torch.int64).reshape(256)
CHUNK_BYTES = 2**24  # packed bytes decoded at a time (their int32 indices: 64 MiB)


@dataclass(frozen=True)
class NvFp4Format:
    """Whose NVFP4 a checkpoint holds, and its group size."""

    method: str  # "compressed-tensors" (the global scale divides) or "modelopt" (it multiplies)
    group_size: int

    @property
    def leaves(self) -> dict[str, str]:
        """Checkpoint leaf name -> the part it is."""
        if self.method == "modelopt":
            return {"weight": "packed", "weight_scale": "scale", "weight_scale_2": "global"}
        return {"weight_packed": "packed", "weight_scale": "scale", "weight_global_scale": "global"}


def nvfp4_format(config: Any) -> NvFp4Format | None:
    """The NVFP4 format of a model's config (transformers' object or config.json as a dict); None for
    another. A ModelOpt algorithm or a compressed-tensors FP4 scheme this module cannot read raises, naming it."""
    quant = quantization_config(config)
    if quant is None:
        return None
    if quant.get("quant_method") == "modelopt":
        algo, group, _, _ = modelopt_settings(quant)
        if algo in MODELOPT_NVFP4_ALGOS:
            return NvFp4Format("modelopt", group or 16)
        if algo not in MODELOPT_FP8_ALGOS:
            raise ValueError(f"quantization_config (ModelOpt) quant_algo {algo!r}: vllmini reads "
                             f"{', '.join(map(repr, [*MODELOPT_FP8_ALGOS, *MODELOPT_NVFP4_ALGOS]))}")  # fmt: skip
        return None
    if quant.get("quant_method") != "compressed-tensors":
        return None
    weights = [(name, (group or {}).get("weights") or {}) for name, group in (quant.get("config_groups") or {}).items()]
    fp4 = [(name, w) for name, w in weights if w.get("type") == "float" and w.get("num_bits") == 4]
    if not fp4 and quant.get("format") != NVFP4_FORMAT:
        return None
    if quant.get("format") != NVFP4_FORMAT or len(fp4) != len(weights) or not weights:
        raise ValueError(f"quantization_config: compressed-tensors FP4 weights are read in format {NVFP4_FORMAT!r}, "
                         f"every config_group FP4 (got format {quant.get('format')!r}, {len(fp4)} of {len(weights)} groups FP4)")  # fmt: skip
    for name, w in fp4:
        field = f"quantization_config.config_groups.{name}.weights"
        if w.get("group_size") != 16 or not w.get("symmetric", True):
            raise ValueError(f"{field}: NVFP4 weights are symmetric, in groups of 16 (got group_size "
                             f"{w.get('group_size')!r}, symmetric {w.get('symmetric')!r})")  # fmt: skip
    return NvFp4Format("compressed-tensors", 16)


def is_nvfp4_part(name: str, tensor: torch.Tensor) -> bool:
    """Whether ``name`` is a packed (uint8) or scale (float8) tensor of an NVFP4 linear (checkpoint_checks)."""
    leaf = name.rpartition(".")[2]
    return (tensor.dtype == torch.uint8 and leaf in ("weight", "weight_packed")) or (
        tensor.dtype == torch.float8_e4m3fn and leaf == "weight_scale")


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """``packed [..., B]`` (uint8, two E2M1 codes a byte, the low nibble first) -> ``[..., 2B]`` float32."""
    flat = packed.reshape(-1)
    out = torch.empty(flat.numel(), dtype=torch.int64)
    for start in range(0, flat.numel(), CHUNK_BYTES):  # (in chunks: the indices are 4x the packed bytes)
        torch.index_select(_PAIR_WORDS, 0, flat[start : start + CHUNK_BYTES].int(), out=out[start : start + CHUNK_BYTES])
    return out.view(torch.float32).view(*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, fmt: NvFp4Format,
                     name: str = "weight") -> torch.Tensor:  # fmt: skip
    """One NVFP4 weight (``packed [..., N, K / 2]`` uint8, ``scale [..., N, K / group]`` float8, a float32
    global scale: one, or one per leading index) -> float32 ``[..., N, K]``."""
    leaves = {part: leaf for leaf, part in fmt.leaves.items()}
    if packed.dtype != torch.uint8 or packed.dim() < 2:
        raise ValueError(f"{name}.{leaves['packed']} must be a uint8 tensor of two or more dimensions, got "
                         f"{packed.dtype} {tuple(packed.shape)}")  # fmt: skip
    *lead, n, half = packed.shape
    k, group = half * 2, fmt.group_size
    if k % group or tuple(scale.shape) != (*lead, n, k // group):
        raise ValueError(f"{name}.{leaves['scale']} has shape {tuple(scale.shape)}; a {tuple(packed.shape)} packed "
                         f"weight ({k} inputs) in groups of {group} needs {(*lead, n, k // group)}")  # fmt: skip
    if global_scale.numel() == 1:
        g = global_scale.to(torch.float32).reshape(())
    elif tuple(global_scale.shape) in (tuple(lead), (*lead, 1)):
        g = global_scale.to(torch.float32).reshape(*lead, 1, 1)
    else:
        raise ValueError(f"{name}.{leaves['global']} has shape {tuple(global_scale.shape)}; expected one value"
                         + (f" or one per {tuple(lead)}" if lead else ""))  # fmt: skip
    scales = scale.to(torch.float32)
    scales = scales / g if fmt.method == "compressed-tensors" else scales * g
    values = e2m1_values(packed).view(*lead, n, k // group, group)
    return values.mul_(scales.unsqueeze(-1)).view(*lead, n, k)


def dequantize_nvfp4_weights(weights: Iterator[tuple[str, torch.Tensor]], fmt: NvFp4Format) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) pairs with each NVFP4 linear dequantized (float32) from its three
    parts, in any order; activation and KV scales dropped; float tensors (excluded layers) as they come."""
    def make(module: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        return dequantize_nvfp4(parts["packed"], parts["scale"], parts["global"], fmt, module)

    return gather_parts(weights, fmt.leaves, {"packed", "scale", "global"}, make, "NVFP4",
                        dropped=(*DROPPED_SUFFIXES, "input_global_scale", "input_zero_point"),
                        is_part=lambda part, t: part != "packed" or t.dtype == torch.uint8)  # fmt: skip
