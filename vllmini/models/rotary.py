"""Rotary position embedding: the inverse frequencies of every rope type vLLM and transformers
share (default, linear, dynamic NTK, llama3, YaRN, LongRoPE), partial rotary dims, and the rotation.

Numerics follow transformers' ``modeling_rope_utils`` (angles in fp32, cos/sin scaled by the
type's attention factor), so the parity tests can demand logits within 1e-4.

Two types change with the sequence length in transformers: ``dynamic`` recomputes its base once
a sequence outgrows ``max_position_embeddings``, and ``longrope`` switches from its short to its
long factors past ``original_max_position_embeddings``. A paged KV cache holds keys already
rotated, so switching mid-sequence would leave them rotated by other frequencies. As vLLM, the
choice is made once per engine from ``max_model_len`` (``RotaryEmbedding.fit_context``): long
factors (or the NTK base for that length) when it exceeds the original context, else the short
factors (the plain frequencies), which equal transformers' on every sequence that fits.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
_ORIGINAL_LEN_TYPES = ("llama3", "yarn", "longrope")  # types that read original_max_position_embeddings


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """One dict for rope settings, whether the config uses transformers 5's ``rope_parameters``
    or the older ``rope_theta`` + ``rope_scaling`` pair, completed as transformers completes it:
    ``partial_rotary_factor``, the model's ``max_position_embeddings`` and, for the types that
    scale from a pretraining length, ``original_max_position_embeddings`` (Phi-3 keeps it beside
    rope_scaling, and that one wins). ``layer_type``: the settings of that kind of layer where
    ``rope_parameters`` holds one set per kind (Gemma 3 under transformers 5)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None)
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    elif scaling:
        params = {**scaling, **params}
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    params["rope_type"] = "longrope" if rope_type == "su" else rope_type  # Phi-3's first name for it
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    params["partial_rotary_factor"] = 1.0 if partial is None else float(partial)
    max_len = getattr(config, "max_position_embeddings", None)
    params["max_position_embeddings"] = max_len
    if params["rope_type"] in _ORIGINAL_LEN_TYPES:
        original = getattr(config, "original_max_position_embeddings", None)
        params["original_max_position_embeddings"] = original or params.get("original_max_position_embeddings") or max_len
    return params


def scaled_context_len(params: dict[str, Any], length: int) -> tuple[int, str]:
    """The context a rope scaling extends ``length`` (config.json's) to, as vLLM derives
    max_model_len, and why: linear and dynamic multiply it by ``factor``, YaRN multiplies its
    ``original_max_position_embeddings``; llama3 and LongRoPE configs state the scaled length."""
    kind, factor = params["rope_type"], params.get("factor")
    if kind == "yarn":
        factor = factor or _yarn_factor(params)
        original = params["original_max_position_embeddings"]
        return int(original * factor), f"yarn: {original} original tokens x{factor}"
    if kind in ("linear", "dynamic") and factor:
        return int(length * float(factor)), f"x{factor} {kind} rope scaling"
    return length, ""


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths are slowed by ``factor``,
    short ones kept, the band between interpolated smoothly."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_factor(params: dict[str, Any]) -> float:
    """YaRN's factor; DeepSeek-style configs leave it out and mean the ratio of the two lengths."""
    return float(params.get("factor") or params["max_position_embeddings"] / params["original_max_position_embeddings"])


def _yarn(params: dict[str, Any], dim: int, base: float) -> tuple[torch.Tensor, float]:
    """YaRN: dims that turn many times within the original context keep their frequency, dims
    that turn less than once are interpolated by ``factor``, a linear ramp between; cos/sin are
    scaled by the attention factor (``0.1 ln(factor) + 1``, or DeepSeek's mscale ratio)."""
    factor = _yarn_factor(params)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    original = params["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times over the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(params.get("beta_fast") or 32), correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep, float(attention)


def _longrope(params: dict[str, Any], dim: int, base: float, context_len: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini): a rescale factor per frequency, the long set
    when the engine's context exceeds the original one; cos/sin scaled by
    ``sqrt(1 + ln(factor) / ln(original length))``."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or (params["max_position_embeddings"] or original) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    key = "long_factor" if context_len > original else "short_factor"
    rescale = params[key]
    if len(rescale) != dim // 2:
        raise ValueError(f"longrope {key} has {len(rescale)} values; the rotary dims need {dim // 2}")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(rescale, dtype=torch.float32) * base**exponents), float(attention)


def inverse_frequencies(params: dict[str, Any], dim: int, context_len: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dim / 2], attention factor)`` in fp32 for ``dim`` rotary dims of an engine
    whose sequences reach ``context_len`` tokens."""
    kind, base = params["rope_type"], float(params["rope_theta"])
    if kind == "yarn":
        return _yarn(params, dim, base)
    if kind == "longrope":
        return _longrope(params, dim, base, context_len)
    if kind == "dynamic" and context_len > (max_len := params["max_position_embeddings"]):
        factor = float(params["factor"])  # the NTK base transformers computes for a sequence of context_len
        base = base * (factor * context_len / max_len - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params)
    elif kind == "linear":  # position interpolation: every angle slowed by factor
        inv_freq = inv_freq / float(params["factor"])
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding over the first ``rotary_dim`` dims of each head (all of them
    unless ``partial_rotary_factor`` < 1); angles computed per forward from the positions (cheap,
    and no cache sized by a 128k context)."""

    def __init__(self, head_dim: int, params: dict[str, Any], interleaved: bool = False) -> None:
        """``interleaved``: the tables hold each frequency for a pair of adjacent dims (GLM style,
        ERNIE 4.5's), as ``apply_rotary(..., interleaved=True)`` reads them, not once per half."""
        super().__init__()
        self.interleaved = interleaved
        rope_type = params["rope_type"]
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        self.rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"partial_rotary_factor={params['partial_rotary_factor']} gives {self.rotary_dim} "
                             f"rotary dims of {head_dim}; they must be even and at least 2")  # fmt: skip
        self.head_dim = head_dim
        self.params = params
        # the longest sequence the engine runs (fit_context); until then the model's own context
        self.context_len = int(params.get("max_position_embeddings") or 0)
        self.attention_scaling = 1.0
        # Built on the meta device (weight_loader), the buffer is only a placeholder until
        # reset_buffers: computing it there would run meta ops, which import torch._dynamo.
        on_meta = torch.empty(0).device.type == "meta"
        inv_freq = torch.empty(self.rotary_dim // 2) if on_meta else self._inv_freq()
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _inv_freq(self, device: torch.device | None = None) -> torch.Tensor:
        inv_freq, self.attention_scaling = inverse_frequencies(self.params, self.rotary_dim, self.context_len)
        return inv_freq.to(device)

    def reset_buffers(self) -> None:
        """Recompute ``inv_freq`` (in fp32) after the model was materialized from the meta device."""
        self.inv_freq = self._inv_freq(self.inv_freq.device)

    def fit_context(self, max_model_len: int) -> None:
        """Choose the length-dependent frequencies (dynamic, longrope) for the engine's
        ``max_model_len``, once, before any KV is written."""
        self.context_len = max_model_len
        self.reset_buffers()

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[T, rotary_dim]`` in fp32 for the flat batch's positions."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = freqs.repeat_interleave(2, dim=-1) if self.interleaved else torch.cat((freqs, freqs), dim=-1)
        if self.attention_scaling == 1.0:
            return emb.cos(), emb.sin()
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def fit_rope_context(model: nn.Module, max_model_len: int) -> None:
    """``fit_context`` on every rotary embedding of ``model``."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.fit_context(max_model_len)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` by per-token angles (HF's rotate_half convention: dim i turns
    with dim i + rotary_dim/2; ``interleaved``: dims 2i and 2i+1 turn together, as GLM's and ERNIE 4.5's,
    with tables from ``RotaryEmbedding(..., interleaved=True)``); with a partial rotary embedding only
    the first ``cos.shape[-1]`` dims turn, the rest pass through."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rot], cos, sin, interleaved), x[..., rot:]), dim=-1)
    if interleaved:
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((-x[..., rot // 2 :], x[..., : rot // 2]), dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
