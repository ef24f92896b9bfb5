"""GPTQ and AWQ checkpoints (integer weights with per-group scales and zero points, 16-bit
activations: vLLM's "wNa16"), dequantized while loading so the model computes in the engine's dtype.

Each linear ``<m>`` comes as ``<m>.qweight`` (int32, 32 / bits values per word, the lowest bits first),
``<m>.qzeros`` (int32, packed along the outputs), ``<m>.scales`` (``[groups, N]``) and, for GPTQ,
``<m>.g_idx`` (each input column's group). The dense weight is ``(q - zero) * scale`` by group, as
``[N, K]``:

- GPTQ (``quant_method: "gptq"``, AutoGPTQ / GPTQModel): ``qweight [K * bits / 32, N]`` packed along the
  inputs; the zeros of the original format (``checkpoint_format`` "gptq", the default) are stored minus
  one, ``gptq_v2``'s as they are; ``desc_act`` checkpoints order the groups by ``g_idx``;
- AWQ (``quant_method: "awq"``, AutoAWQ's ``gemm`` version): ``qweight [K, N / 8]`` packed along the
  outputs, the eight values of a word in AWQ's order (columns 0, 2, 4, 6, 1, 3, 5, 7 from the lowest
  bits up); groups are consecutive runs of ``group_size`` inputs;
- compressed-tensors' ``pack-quantized`` int weights (llm-compressor's ``-quantized.w4a16`` / ``w8a16``
  exports): ``<m>.weight_packed [N, ceil(K * bits / 32)]`` packed along the inputs, each value stored
  plus ``2**(bits - 1)`` (signed), ``weight_scale [N, groups]`` (one group: per channel),
  ``weight_zero_point`` (asymmetric: packed along the outputs), ``weight_g_idx`` (act-order), ``weight_shape``.

The model then holds dense weights: the memory of a bf16 (or fp32) model and no integer kernel; what
it computes is the quantized model's weights exactly (each ``(q - zero) * scale`` is one float32
multiply of small integers by the scale, then rounded once to the engine's dtype).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

from vllmini.models.quant_config import gather_parts, quantization_config

PARTS = ("qweight", "qzeros", "scales", "g_idx")
CT_PARTS = {"weight_packed": "qweight", "weight_zero_point": "qzeros", "weight_scale": "scales",
            "weight_g_idx": "g_idx", "weight_shape": "shape"}  # (compressed-tensors' names)
# the parts stored as integers (words, zeros, group indices, shape), as the name suffixes checkpoint_checks lets through
INTEGER_PART_SUFFIXES = tuple(f".{leaf}" for leaf, part in [*zip(PARTS, PARTS), *CT_PARTS.items()] if part != "scales")
UNPACKED_INT_FORMATS = ("int-quantized", "naive-quantized")  # compressed-tensors' formats of int8-stored values
AWQ_COLUMNS = (0, 4, 1, 5, 2, 6, 3, 7)  # column c of a packed word is the word's value number AWQ_COLUMNS[c]


@dataclass(frozen=True)
class WNA16Format:
    """What a GPTQ or AWQ ``quantization_config`` says."""

    method: str  # "gptq" or "awq"
    bits: int
    group_size: int  # inputs per group; -1: one group for the whole row
    zero_offset: int  # added to the stored zeros (1 for GPTQ's original format)
    zero_point: bool  # False: symmetric, the zero is 2**(bits - 1) (AWQ without zero points)
    desc_act: bool  # GPTQ's act-order: each input column's group comes from g_idx

    @property
    def parts(self) -> dict[str, str]:
        """Checkpoint leaf name -> the part it is."""
        return CT_PARTS if self.method == "compressed-tensors" else {p: p for p in PARTS}


def wna16_format(config: Any) -> WNA16Format | None:
    """The GPTQ/AWQ format of a model's config (transformers' object or config.json as a dict); None for
    another. A setting this module cannot read raises, naming the field."""
    quant = quantization_config(config)
    if quant is None:
        return None
    if quant.get("quant_method") == "compressed-tensors":
        return _compressed_tensors_format(quant)
    if quant.get("quant_method") not in ("gptq", "awq"):
        return None
    method = quant["quant_method"]
    bits = quant.get("bits", quant.get("w_bit"))
    group = quant.get("group_size", quant.get("q_group_size", 128))
    if method == "gptq":
        allowed_bits, fmt = (2, 4, 8), quant.get("checkpoint_format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization_config.checkpoint_format {fmt!r}: vllmini reads 'gptq' and 'gptq_v2'")
    else:
        allowed_bits, fmt = (4,), None
        if (quant.get("version") or "gemm").lower() != "gemm":
            raise ValueError(f"quantization_config.version {quant.get('version')!r}: vllmini reads AWQ's 'gemm' layout")
    if bits not in allowed_bits:
        raise ValueError(f"quantization_config.bits is {bits!r}; vllmini reads {method} weights of {allowed_bits} bits")
    if not isinstance(group, int) or isinstance(group, bool) or not (group == -1 or group > 0):
        raise ValueError(f"quantization_config.group_size must be a positive integer or -1, got {group!r}")
    return WNA16Format(method, bits, group, zero_offset=1 if fmt == "gptq" else 0,
                       zero_point=bool(quant.get("zero_point", True)) if method == "awq" else True,
                       desc_act=method == "gptq" and bool(quant.get("desc_act", False)))  # fmt: skip


def _compressed_tensors_format(quant: dict) -> WNA16Format | None:
    """compressed-tensors' int weights (None: its float8 ones, models/fp8.py): one scheme for every group."""
    groups = quant.get("config_groups") or {}
    weights = [(name, (group or {}).get("weights") or {}) for name, group in groups.items()]
    if not weights or any(w.get("type") != "int" for _, w in weights):
        return None
    schemes = {(w.get("num_bits"), w.get("strategy"), w.get("group_size"), w.get("symmetric", True), w.get("actorder"))
               for _, w in weights}  # fmt: skip
    name, first = weights[0]
    field = f"quantization_config.config_groups.{name}.weights"
    fmt = quant.get("format")
    if fmt in UNPACKED_INT_FORMATS:
        return None  # (one int8 per value: models/int8.py)
    if len(schemes) > 1 or fmt != "pack-quantized":
        raise ValueError(f"quantization_config: compressed-tensors int weights are read in one scheme, format "
                         f"'pack-quantized' (got format {fmt!r}, {len(schemes)} schemes)")  # fmt: skip
    bits, strategy = first.get("num_bits"), first.get("strategy")
    if bits not in (2, 4, 8):
        raise ValueError(f"{field}.num_bits is {bits!r}; vllmini reads packed int weights of 2, 4 or 8 bits")
    if strategy not in ("group", "channel"):
        raise ValueError(f"{field}.strategy is {strategy!r}; vllmini reads 'group' and 'channel' int weights")
    group = first.get("group_size") if strategy == "group" else -1
    if not isinstance(group, int) or isinstance(group, bool) or not (group == -1 or group > 0):
        raise ValueError(f"{field}.group_size must be a positive integer, got {group!r}")
    return WNA16Format("compressed-tensors", bits, group, zero_offset=0, zero_point=not first.get("symmetric", True),
                       desc_act=first.get("actorder") == "group")  # fmt: skip


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32 / bits values (the lowest bits first), spread along ``dim``."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    if dim == 0:  # [K / per, per, N] -> [K, N]
        return ((words.unsqueeze(1) >> shifts[:, None]) & ((1 << bits) - 1)).reshape(-1, words.shape[1])
    return ((words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(words.shape[0], -1)


def dequantize_wna16(parts: dict[str, torch.Tensor], fmt: WNA16Format, name: str = "weight") -> torch.Tensor:
    """One linear's ``qweight`` / ``qzeros`` / ``scales`` (/ ``g_idx``) -> its float32 weight ``[N, K]``."""
    if fmt.method == "compressed-tensors":
        return _dequantize_packed(parts, fmt, name)
    qweight, scales = parts["qweight"], parts["scales"].to(torch.float32)
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"{name}.qweight must be a 2-D int32 tensor, got {qweight.dtype} {tuple(qweight.shape)}")
    if fmt.method == "gptq":
        q = _unpack(qweight, fmt.bits, dim=0)  # [K, N]
    else:
        q = _unpack(qweight, fmt.bits, dim=1).view(qweight.shape[0], -1, 8)[..., list(AWQ_COLUMNS)].flatten(1)
    k, n = q.shape
    groups = 1 if fmt.group_size == -1 else -(-k // fmt.group_size)
    if tuple(scales.shape) != (groups, n):
        raise ValueError(f"{name}.scales has shape {tuple(scales.shape)}; a [{k} x {n}] weight in groups of "
                         f"{fmt.group_size} needs ({groups}, {n})")  # fmt: skip
    if fmt.zero_point:
        zeros = _unpack(parts["qzeros"], fmt.bits, dim=1)
        if fmt.method == "awq":
            zeros = zeros.view(zeros.shape[0], -1, 8)[..., list(AWQ_COLUMNS)].flatten(1)
        if tuple(zeros.shape) != (groups, n):
            raise ValueError(f"{name}.qzeros holds {tuple(zeros.shape)} zeros; the scales are ({groups}, {n})")
        zeros = zeros + fmt.zero_offset
    else:
        zeros = torch.full((groups, n), 1 << (fmt.bits - 1), dtype=torch.int32)
    dense, zeros = q.to(torch.float32), zeros.to(torch.float32)  # (small integers: the difference is exact)
    group_of = _groups(parts.get("g_idx"), k, groups, fmt, name)
    size = k if fmt.group_size == -1 else fmt.group_size
    if k % size == 0 and torch.equal(group_of, torch.arange(k) // size):  # runs of inputs: broadcast, ~4x a gather
        runs = dense.view(groups, size, n)
        runs.sub_(zeros.unsqueeze(1)).mul_(scales.unsqueeze(1))
    else:
        dense.sub_(zeros[group_of]).mul_(scales[group_of])
    return dense.t().contiguous()


def _dequantize_packed(parts: dict[str, torch.Tensor], fmt: WNA16Format, name: str) -> torch.Tensor:
    """compressed-tensors' ``pack-quantized`` linear -> its float32 weight ``[N, K]``."""
    packed, scales, offset = parts["qweight"], parts["scales"].to(torch.float32), 1 << (fmt.bits - 1)
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"{name}.weight_packed must be a 2-D int32 tensor, got {packed.dtype} {tuple(packed.shape)}")
    n, k = (int(v) for v in parts["shape"].tolist()) if "shape" in parts else (packed.shape[0], packed.shape[1] * 32 // fmt.bits)
    q = _unpack(packed, fmt.bits, dim=1)[:, :k].to(torch.float32).sub_(offset)  # [N, K], signed
    groups = 1 if fmt.group_size == -1 else -(-k // fmt.group_size)
    if q.shape != (n, k) or tuple(scales.shape) != (n, groups):
        raise ValueError(f"{name}: weight_packed {tuple(packed.shape)} and weight_scale {tuple(scales.shape)} do not "
                         f"make a [{n} x {k}] weight in groups of {fmt.group_size} (scales ({n}, {groups}))")  # fmt: skip
    zeros = None
    if fmt.zero_point:
        zeros = _unpack(parts["qzeros"], fmt.bits, dim=0)[:n].to(torch.float32).sub_(offset)  # [N, groups]
        if tuple(zeros.shape) != (n, groups):
            raise ValueError(f"{name}.weight_zero_point holds {tuple(zeros.shape)} zeros; the scales are ({n}, {groups})")
    group_of = _groups(parts.get("g_idx"), k, groups, fmt, name)
    if zeros is not None:
        q.sub_(zeros[:, group_of])
    return q.mul_(scales[:, group_of])


def _groups(g_idx: torch.Tensor | None, k: int, groups: int, fmt: WNA16Format, name: str) -> torch.Tensor:
    """Each input column's group: ``g_idx`` (GPTQ's, needed with act-order), else runs of ``group_size``."""
    if g_idx is None:
        return torch.arange(k) // (k if fmt.group_size == -1 else fmt.group_size)
    g_idx = g_idx.to(torch.int64)
    if tuple(g_idx.shape) != (k,) or (k and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups)):
        raise ValueError(f"{name}.g_idx must give each of the {k} input columns a group in [0, {groups})")
    return g_idx


def dequantize_wna16_weights(weights: Iterator[tuple[str, torch.Tensor]], fmt: WNA16Format) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) pairs with each quantized linear's parts gathered (in any order,
    from any shard) and given as one dense ``<m>.weight``; other tensors pass as they come."""
    needed = {"qweight", "scales"} | ({"qzeros"} if fmt.zero_point else set()) | ({"g_idx"} if fmt.desc_act else set())
    if fmt.method == "compressed-tensors":
        needed.add("shape")
    return gather_parts(weights, fmt.parts, needed, lambda module, parts: dequantize_wna16(parts, fmt, module), fmt.method.upper())
