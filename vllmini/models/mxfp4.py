"""MXFP4 (OCP microscaling FP4), the format OpenAI publishes gpt-oss's expert weights in
(``quantization_config.quant_method == "mxfp4"``): vllmini dequantizes them while loading, as it does
a GGUF file's, and computes in the engine's dtype.

Each run of 32 values along a row shares one scale, a power of two stored as a biased exponent byte
(E8M0: 2**(s - 127)); each value is a 4-bit E2M1 float (sign, two exponent bits, one mantissa bit),
two per byte, the low nibble first. A tensor comes as ``<name>_blocks [..., rows, G, 16]`` (uint8)
and ``<name>_scales [..., rows, G]`` (uint8): the dense tensor is ``[..., rows, G * 32]``.
Every such value is exact in bfloat16 (and float32), so dequantizing loses nothing. (A scale byte of
0xFF, NaN in the OCP format, gives NaN.)
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from vllmini.models.quant_config import quantization_config

MXFP4_SUFFIXES = ("_blocks", "_scales")
# the 16 E2M1 codes' values: sign bit 3, then exponent and mantissa
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


# scale groups dequantized at a time (2**20: 32 Mi values; the int64 indices of their bytes 128 MiB)
CHUNK_GROUPS = 2**20


def is_mxfp4(config: Any) -> bool:
    """Whether a model's config (transformers' object, or config.json as a dict) says its weights are MXFP4."""
    return (quantization_config(config) or {}).get("quant_method") == "mxfp4"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``blocks [..., G, 16]`` and ``scales [..., G]`` (uint8) -> ``[..., G * 32]`` in ``dtype``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8 (got {blocks.dtype} and {scales.dtype})")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         "(blocks [..., G, 16], scales [..., G])")  # fmt: skip
    # each byte's two values (low nibble first): one lookup per byte instead of one per nibble; the
    # values times their power-of-two scale are exact in bfloat16 and float32 (the same exponent range)
    work = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    pairs = torch.tensor([[E2M1_VALUES[b & 0x0F], E2M1_VALUES[b >> 4]] for b in range(256)], dtype=work)
    groups, scales = blocks.reshape(-1, 16), scales.reshape(-1)
    out = torch.empty(groups.shape[0], 32, dtype=dtype)
    for start in range(0, groups.shape[0], CHUNK_GROUPS):  # (in chunks: the int64 indices are 8x the packed bytes)
        chunk = groups[start : start + CHUNK_GROUPS]
        values = pairs.index_select(0, chunk.reshape(-1).long()).view(-1, 32)
        exponents = scales[start : start + CHUNK_GROUPS].to(torch.int32).sub_(127).unsqueeze(-1)
        out[start : start + CHUNK_GROUPS] = values * torch.ldexp(torch.ones(exponents.shape, dtype=work), exponents)
    return out.view(*blocks.shape[:-1], 32).flatten(-2)


def dequantize_mxfp4_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's (name, tensor) pairs with each MXFP4 pair (``<name>_blocks`` and ``<name>_scales``,
    in either order) dequantized once both have come, as ``<name>`` in transformers' in-memory layout
    (the pair holds ``[E, out, in]``; the tensor is ``[E, in, out]``); the rest as they come."""
    pending: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        suffix = next((s for s in MXFP4_SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        base = name[: -len(suffix)]
        other = base + ("_scales" if suffix == "_blocks" else "_blocks")
        if other not in pending:
            pending[name] = tensor
            continue
        blocks, scales = (tensor, pending.pop(other)) if suffix == "_blocks" else (pending.pop(other), tensor)
        yield base, dequantize_mxfp4(blocks, scales).transpose(-2, -1)
    if pending:
        raise ValueError(f"MXFP4 tensors without their blocks or scales: {', '.join(sorted(pending))}")
