"""What the KV cache stores: ``EngineArgs.kv_cache_dtype``, vLLM's names.

``auto`` keeps the model's dtype. ``fp8`` (= ``fp8_e4m3``) and ``fp8_e5m2`` store one byte per
element: 2x the tokens of a 16-bit cache in the same memory, 4x a float32 one. ``bfloat16``
halves a float32 model's cache. Scales are 1.0, as vLLM's without calibrated ``k_scale`` /
``v_scale``: K and V are stored as they are, saturated at the format's largest finite value
(e4m3: 448; e5m2: 57344), since a cast past it gives NaN or inf.

Attention reads every key and value back from this precision, the current step's own tokens
included (``round_to_cache``), as flash-attn does when it reads a chunk's K/V from the cache:
so a sequence's output does not depend on how its prompt was chunked or whether its prefix
came from the prefix cache.
"""
from __future__ import annotations

import torch

# vLLM's kv_cache_dtype names -> the stored dtype (None: the model's)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_kv_cache_dtype(name: object) -> None:
    """A ValueError naming ``kv_cache_dtype`` unless it is one of ``KV_CACHE_DTYPES``."""
    if not isinstance(name, str) or name not in KV_CACHE_DTYPES:
        others = " (vLLM's fp8_inc and fp8_ds_mla are not built)" if name in ("fp8_inc", "fp8_ds_mla") else ""
        raise ValueError(f"kv_cache_dtype={name!r} is not supported{others}; accepted: {list(KV_CACHE_DTYPES)}")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV cache holds for an engine running in ``model_dtype``. A cache wider than
    the model (bfloat16 for a float16 model) is refused: it would store nothing more."""
    check_kv_cache_dtype(name)
    dtype = KV_CACHE_DTYPES[name] or model_dtype
    if dtype.itemsize > model_dtype.itemsize or (dtype.itemsize == model_dtype.itemsize and dtype != model_dtype):
        raise ValueError(f"kv_cache_dtype={name!r} does not fit a {model_dtype} model: the cache would hold "
                         f"{dtype}, no smaller than the model's own values (use 'auto' or fp8)")  # fmt: skip
    return dtype


def round_to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache will hold it, in ``x``'s dtype: what attention must see of the step's
    own K/V (nothing to do when the cache holds x's dtype)."""
    if cache_dtype == x.dtype:
        return x
    return to_cache(x, cache_dtype).to(x.dtype)


def indexable(t: torch.Tensor) -> torch.Tensor:
    """``t``, or for fp8 its bytes (a uint8 view of the same memory): torch's indexed copies and
    selects (``index_copy_``, ``index_select``) have no fp8 kernels on every device, and moving
    whole elements as bytes is the same move."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` cast to ``cache_dtype``, saturated at an fp8 format's largest finite value."""
    if cache_dtype in FP8_DTYPES:
        top = torch.finfo(cache_dtype).max
        x = x.clamp(-top, top)
    return x.to(cache_dtype)
