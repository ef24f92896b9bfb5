"""compressed-tensors' unpacked int weights (``format: "int-quantized"``, llm-compressor's W8A8 int8
exports, and ``"naive-quantized"`` int ones, W8A16 among them): dequantized while loading, as
models/gptq_awq.py does the packed ones, so the model computes in the engine's dtype.

Each quantized linear ``<m>`` comes as ``<m>.weight`` (int8, one value per element, signed), ``<m>.weight_scale``
and, for an asymmetric scheme, ``<m>.weight_zero_point`` (int8); ``<m>.weight_g_idx`` gives each input
column's group with ``actorder: "group"``. The scale (and zero point) is one per tensor (``[1]``), per
output channel (``[N, 1]``), per group of inputs (``[N, ceil(K / group_size)]``) or per block
(``[ceil(N / bn), ceil(K / bk)]``); the dense weight is ``(q - zero) * scale`` in float32, which is
compressed-tensors' own ``dequantize`` (exact: small integers times the scale, rounded once to the
engine's dtype). The activations' quantization (W8A8's dynamic per-token int8, or a static
``input_scale`` / ``input_zero_point``, dropped) is not applied: the model runs dense on those weights.
Layers the export left unquantized (``ignore``: ``lm_head``, a MoE router) have float weights and pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

from vllmini.models.fp8 import DROPPED_SUFFIXES, _block
from vllmini.models.gptq_awq import UNPACKED_INT_FORMATS
from vllmini.models.quant_config import gather_parts, quantization_config

LEAVES = {"weight": "weight", "weight_scale": "scale", "weight_zero_point": "zero", "weight_g_idx": "g_idx"}
INT_LEAVES = ("weight", "weight_zero_point", "weight_g_idx")  # the ones stored as integers (checkpoint_checks)
INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)
STRATEGIES = ("tensor", "channel", "group", "block")


@dataclass(frozen=True)
class IntFormat:
    """What a compressed-tensors ``int-quantized`` / ``naive-quantized`` config says of its int weights."""

    bits: int
    strategy: str  # one of STRATEGIES
    group_size: int | None  # inputs per group ("group")
    block: tuple[int, int] | None  # a scale tile's [rows, columns] ("block")
    symmetric: bool  # False: a weight_zero_point per scale
    actorder: bool  # True: each input column's group is in weight_g_idx


def int_format(config: Any) -> IntFormat | None:
    """The unpacked int format of a model's config (transformers' object or config.json as a dict); None
    for another. A scheme this module cannot read raises, naming the field."""
    quant = quantization_config(config)
    if quant is None or quant.get("quant_method") != "compressed-tensors" or quant.get("format") not in UNPACKED_INT_FORMATS:
        return None
    weights = [(name, (group or {}).get("weights") or {}) for name, group in (quant.get("config_groups") or {}).items()]
    if not weights or any(w.get("type") != "int" for _, w in weights):
        return None  # (float8 weights in naive-quantized: models/fp8.py)
    keys = ("num_bits", "strategy", "group_size", "block_structure", "symmetric", "actorder")
    if len({tuple(str(w.get(key)) for key in keys) for _, w in weights}) > 1:
        raise ValueError(f"quantization_config: compressed-tensors {quant['format']} int weights are read in one scheme "
                         f"(got {len(weights)} config_groups that differ)")  # fmt: skip
    name, first = weights[0]
    field = f"quantization_config.config_groups.{name}.weights"
    bits, strategy = first.get("num_bits"), first.get("strategy")
    if not isinstance(bits, int) or isinstance(bits, bool) or not 2 <= bits <= 8:
        raise ValueError(f"{field}.num_bits is {bits!r}; vllmini reads unpacked int weights of 2 to 8 bits")
    if strategy not in STRATEGIES:
        raise ValueError(f"{field}.strategy is {strategy!r}; vllmini reads {', '.join(map(repr, STRATEGIES))} int weights")
    group = first.get("group_size")
    if strategy == "group" and (not isinstance(group, int) or isinstance(group, bool) or group < 1):
        raise ValueError(f"{field}.group_size must be a positive integer, got {group!r}")
    block = _block(first.get("block_structure"), f"config_groups.{name}.weights.block_structure") if strategy == "block" else None
    if strategy == "block" and block is None:
        raise ValueError(f"{field}.block_structure must be two positive integers for strategy 'block'")
    return IntFormat(bits, strategy, group if strategy == "group" else None, block, bool(first.get("symmetric", True)),
                     first.get("actorder") == "group" and strategy == "group")  # fmt: skip


def is_int_part(name: str, tensor: torch.Tensor) -> bool:
    """Whether ``name`` is an int tensor this format stores (checkpoint_checks lets them through)."""
    return tensor.dtype in INT_DTYPES and name.rpartition(".")[2] in INT_LEAVES


def _per_value(t: torch.Tensor, n: int, k: int, fmt: IntFormat, g_idx: torch.Tensor | None, what: str) -> torch.Tensor:
    """A scale or zero point ``t`` (float32) spread over the ``[n, k]`` weight (broadcastable to it; by
    group without ``g_idx``: to its ``[n, groups, group_size]`` view, no gathered copy)."""
    if fmt.strategy == "tensor" and t.numel() == 1:
        return t.reshape(())
    if fmt.strategy == "channel" and tuple(t.shape) in ((n, 1), (n,)):
        return t.reshape(n, 1)
    if fmt.strategy == "group" and tuple(t.shape) == (n, k // fmt.group_size):
        return t[:, g_idx] if g_idx is not None else t.unsqueeze(-1)  # (else: to the weight's [n, groups, size] view)
    if fmt.strategy == "block" and tuple(t.shape) == (-(-n // fmt.block[0]), -(-k // fmt.block[1])):
        return t.repeat_interleave(fmt.block[0], dim=0)[:n].repeat_interleave(fmt.block[1], dim=1)[:, :k]
    want = {"tensor": "one value", "channel": f"({n}, 1)", "group": f"({n}, {k // (fmt.group_size or 1)})",
            "block": f"({-(-n // fmt.block[0])}, {-(-k // fmt.block[1])})" if fmt.block else ""}[fmt.strategy]  # fmt: skip
    raise ValueError(f"{what} has shape {tuple(t.shape)}; a [{n} x {k}] weight quantized by {fmt.strategy} needs {want}")


def dequantize_int(parts: dict[str, torch.Tensor], fmt: IntFormat, name: str = "weight") -> torch.Tensor:
    """One linear's int8 ``weight``, ``weight_scale`` (/ ``weight_zero_point``, ``weight_g_idx``) -> its float32 weight ``[N, K]``."""
    q = parts["weight"]
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"{name}.weight must be a 2-D int8 tensor, got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    if fmt.strategy == "group" and k % fmt.group_size:
        raise ValueError(f"{name}.weight has {k} inputs, no multiple of group_size {fmt.group_size} (compressed-tensors "
                         "itself refuses such a weight)")  # fmt: skip
    g_idx = None
    if fmt.actorder:
        g_idx = parts["g_idx"].to(torch.int64)
        groups = k // fmt.group_size
        if tuple(g_idx.shape) != (k,) or (k and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups)):
            raise ValueError(f"{name}.weight_g_idx must give each of the {k} input columns a group in [0, {groups})")
    dense = q.to(torch.float32)
    grouped = fmt.strategy == "group" and g_idx is None  # (runs of inputs: broadcast over a view, ~3x a gathered copy)
    view = dense.view(n, k // fmt.group_size, fmt.group_size) if grouped else dense
    if not fmt.symmetric:
        view.sub_(_per_value(parts["zero"].to(torch.float32), n, k, fmt, g_idx, f"{name}.weight_zero_point"))
    view.mul_(_per_value(parts["scale"].to(torch.float32), n, k, fmt, g_idx, f"{name}.weight_scale"))
    return dense


def dequantize_int_weights(weights: Iterator[tuple[str, torch.Tensor]], fmt: IntFormat) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) pairs with each int8 linear dequantized (float32) from its parts, in
    any order; activation and KV scales dropped; float tensors (unquantized layers) as they come."""
    needed = {"weight", "scale"} | (set() if fmt.symmetric else {"zero"}) | ({"g_idx"} if fmt.actorder else set())
    return gather_parts(weights, LEAVES, needed, lambda module, parts: dequantize_int(parts, fmt, module), "int-quantized",
                        dropped=(*DROPPED_SUFFIXES, "input_zero_point"),
                        is_part=lambda part, t: part != "weight" or t.dtype == torch.int8)  # fmt: skip
