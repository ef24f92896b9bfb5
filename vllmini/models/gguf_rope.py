"""Rotary-embedding settings of GGUF files, as llama.cpp writes them, turned into HF config fields.

transformers' GGUF config reader drops them, so a converted model would rotate with the plain
frequencies and answer wrongly past (or even within) its original context:
  * rope scaling keys: ``{arch}.rope.scaling.type`` / ``.factor`` (linear; a factor without a
    type means linear, as does the old ``rope.scale_linear``) and YaRN (``.original_context_length``,
    ``.yarn_beta_fast`` / ``.yarn_beta_slow``: Qwen3's long-context files);
  * LongRoPE (Phi-3-128k, Phi-3.5, Phi-4-mini: ``phi3`` files): the per-frequency factors are the
    tensors ``rope_factors_long.weight`` / ``rope_factors_short.weight``, with
    ``rope.scaling.original_context_length`` and ``rope.scaling.attn_factor`` beside them;
  * Llama 3.1 / 3.2's ``llama3`` scaling: llama.cpp stores only its result, a divisor per
    frequency (``rope_freqs.weight``); the parameters are read back from it (``llama3_rope``);
  * a partial rotary embedding (``rope.dimension_count`` below the head size: Phi-4-mini's 3/4).
What cannot be mapped exactly is refused before anything is written.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from vllmini.models.gguf_moe import field_value

LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
LLAMA3_TENSOR = "rope_freqs.weight"  # Llama 3.1+: each frequency's divisor, from the llama3 rope parameters
ROPE_TENSORS = (*LONGROPE_TENSORS, LLAMA3_TENSOR)  # read into config.json, not weights
# llama.cpp's YaRN keys beyond the HF ones; their meaning differs from transformers' attention factor
_YARN_UNMAPPED = ("attn_factor", "yarn_attn_factor", "yarn_ext_factor", "yarn_log_multiplier")


def rope_scaling(reader, gguf_path: Path, arch: str) -> dict[str, Any] | None:
    """The GGUF's rope scaling keys as HF ``rope_parameters`` (None: none); other types are refused."""
    def key(name: str):
        return field_value(reader, f"{arch}.rope.{name}")

    kind, factor = key("scaling.type"), key("scaling.factor")
    if factor is None:
        factor = key("scale_linear")
    unmapped = [name for name in _YARN_UNMAPPED if key(f"scaling.{name}") is not None] if kind == "yarn" else []
    if kind not in (None, "", "none", "linear", "yarn") or unmapped:
        what = f"{kind!r}" + (f" with {', '.join(unmapped)}" if unmapped else "")
        raise ValueError(
            f"{gguf_path}: rope scaling {what} is not supported by the GGUF conversion; "
            "use the model's HF safetensors checkpoint instead"
        )
    if kind == "yarn":
        original = key("scaling.original_context_length")
        if factor is None or original is None:
            raise ValueError(f"{gguf_path}: yarn rope scaling needs {arch}.rope.scaling.factor and "
                             f"{arch}.rope.scaling.original_context_length")  # fmt: skip
        betas = {hf: float(v) for hf, name in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"))
                 if (v := key(f"scaling.{name}")) is not None}  # fmt: skip
        return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original), **betas}
    if kind in ("none", "") or factor is None or float(factor) in (0.0, 1.0):
        return None
    return {"rope_type": "linear", "factor": float(factor)}


def rotary_dims(reader, gguf_path: Path, arch: str) -> tuple[int, int]:
    """(rotary dims, head dim); a partial rotary embedding only where the file's q/k are stored as
    HF's (phi3: llama files' q/k rows are permuted over the whole head for llama.cpp's kernel)."""
    heads = int(field_value(reader, f"{arch}.attention.head_count"))
    key_length = field_value(reader, f"{arch}.attention.key_length")
    head_dim = int(key_length) if key_length is not None else int(field_value(reader, f"{arch}.embedding_length")) // heads
    rotary = field_value(reader, f"{arch}.rope.dimension_count")
    rotary = head_dim if rotary is None else int(rotary)
    if rotary != head_dim and arch != "phi3":
        raise ValueError(f"{gguf_path}: partial rotary embedding ({rotary} of {head_dim} dims) is not supported "
                         f"for {arch!r} files")  # fmt: skip
    return rotary, head_dim


def longrope(reader, gguf_path: Path, arch: str) -> dict[str, Any] | None:
    """LongRoPE's ``rope_parameters`` from the factor tensors (None: the file has none)."""
    tensors = {t.name: t for t in reader.tensors if t.name in LONGROPE_TENSORS}
    if not tensors:
        return None
    missing = [name for name in LONGROPE_TENSORS if name not in tensors]
    original = field_value(reader, f"{arch}.rope.scaling.original_context_length")
    if arch != "phi3" or missing or original is None:
        why = (f"is only read for phi3 files, not {arch!r}" if arch != "phi3" else
               f"needs {', '.join(missing)}" if missing else f"needs {arch}.rope.scaling.original_context_length")
        raise ValueError(f"{gguf_path}: LongRoPE scaling (rope_factors_long/short) {why}")
    rotary, _ = rotary_dims(reader, gguf_path, arch)
    factors = {}
    for name, hf in zip(LONGROPE_TENSORS, ("long_factor", "short_factor")):
        values = [float(v) for v in tensors[name].data.reshape(-1)]
        if len(values) != rotary // 2:
            raise ValueError(f"{gguf_path}: {name} has {len(values)} factors; {rotary} rotary dims need {rotary // 2}")
        factors[hf] = values
    params = {"rope_type": "longrope", **factors, "original_max_position_embeddings": int(original)}
    if (attn_factor := field_value(reader, f"{arch}.rope.scaling.attn_factor")) is not None:
        params["attention_factor"] = float(attn_factor)  # (the value llama.cpp computed from HF's config)
    return params


def llama3_rope(reader, gguf_path: Path, arch: str) -> dict[str, Any] | None:
    """Llama 3's rope parameters read back from ``rope_freqs.weight`` (None: no such tensor).

    The divisor of a frequency with wavelength ``w`` is 1 below ``old / high``, ``factor``
    above ``old / low``, and between them ``1 / ((1 - s) / factor + s)`` with
    ``s = (old / w - low) / (high - low)``, linear in ``1 / w``. Scaling old, low and high
    together changes nothing, so low is taken as 1 and the line through the middle band gives
    high and old (Llama 3.1: 1, 4, 8192). The parameters found must give the file's divisors
    back, else the file is refused."""
    tensor = next((t for t in reader.tensors if t.name == LLAMA3_TENSOR), None)
    if tensor is None:
        return None
    if arch != "llama":
        raise ValueError(f"{gguf_path}: {LLAMA3_TENSOR} (Llama 3 rope scaling) is only read for llama files, not {arch!r}")
    rotary, _ = rotary_dims(reader, gguf_path, arch)
    divisors = np.asarray(tensor.data, dtype=np.float64).reshape(-1)
    if len(divisors) != rotary // 2:
        raise ValueError(f"{gguf_path}: {LLAMA3_TENSOR} has {len(divisors)} values; {rotary} rotary dims need {rotary // 2}")
    base = float(field_value(reader, f"{arch}.rope.freq_base") or 10000.0)
    wavelen = 2 * np.pi * base ** (np.arange(0, rotary, 2) / rotary)
    factor = float(divisors.max())
    if factor <= 1.0:
        return None
    middle = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    params = None
    if middle.sum() >= 2:
        smooth = (1 / divisors[middle] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelen[middle], smooth, 1)
        high, old = 1 - 1 / intercept, -slope / intercept
        params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                  "high_freq_factor": round(float(high), 6), "original_max_position_embeddings": round(float(old))}
    if params is None or not np.allclose(_llama3_divisors(params, wavelen), divisors, rtol=1e-5, atol=0):
        raise ValueError(f"{gguf_path}: {LLAMA3_TENSOR} does not follow Llama 3's rope scaling (or has fewer than "
                         "two frequencies between its bands); use the model's HF safetensors checkpoint instead")
    return params


def _llama3_divisors(params: dict[str, Any], wavelen: np.ndarray) -> np.ndarray:
    """llama.cpp's divisors for ``params`` (its converter's formula)."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old = params["original_max_position_embeddings"]
    smooth = (old / wavelen - low) / (high - low)
    middle = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, middle))


def rope_config(reader, gguf_path: Path, arch: str) -> dict[str, Any]:
    """The config.json fields to set: ``rope_parameters`` entries (merged into transformers' own)
    and, for Phi-3, ``original_max_position_embeddings`` and ``partial_rotary_factor`` beside them."""
    rotary, head_dim = rotary_dims(reader, gguf_path, arch)
    fields: dict[str, Any] = {}
    params = longrope(reader, gguf_path, arch) or llama3_rope(reader, gguf_path, arch) or \
        rope_scaling(reader, gguf_path, arch)
    if params is not None:
        fields["rope_parameters"] = params
        if params["rope_type"] == "longrope":  # (Phi3Config reads it at the top level)
            fields["original_max_position_embeddings"] = params["original_max_position_embeddings"]
    if rotary != head_dim:
        fields["partial_rotary_factor"] = rotary / head_dim
        fields.setdefault("rope_parameters", {})["partial_rotary_factor"] = rotary / head_dim
    return fields
