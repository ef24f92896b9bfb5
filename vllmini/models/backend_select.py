"""Which attention backend an engine runs, chosen once at start-up from the device, dtype,
block size and what is installed (see ``select_backend``); ``get_backend`` hands out the
callable. The start-up check that a chosen backend really works is models/backend_check.py.
"""
from __future__ import annotations

import inspect
import logging

import torch

from vllmini.models.attention import AttentionBackend, flash_attention, torch_attention, torch_varlen_backend
from vllmini.models.cpu_attention import MODEL_DTYPES, cpu_attention

logger = logging.getLogger("vllmini")

BACKEND_NAMES = ("torch", "cpu", "flash_attn", "torch_varlen", "triton")
FLASH_BLOCK_MULTIPLE = 256  # flash-attn 2's paged kernel (also vendored in torch): page size % 256 == 0


def get_backend(name: str) -> AttentionBackend:
    """The callable for a name that ``select_backend`` returned."""
    if name == "torch":
        return torch_attention
    if name == "flash_attn":
        return flash_attention
    if name == "torch_varlen":
        backend = torch_varlen_backend()
        if backend is None:
            raise ValueError("attention_backend='torch_varlen' needs torch.nn.attention.varlen.varlen_attn with block_table")
        return backend
    if name == "triton":
        from vllmini.models.triton_attention import triton_attention

        return triton_attention
    if name == "cpu":
        return cpu_attention
    raise ValueError(f"attention_backend={name!r} is not one of {list(BACKEND_NAMES)}")


def _triton_importable() -> bool:
    """Triton (it ships with CUDA builds of torch; CPU builds lack it)."""
    try:
        import triton.language  # noqa: F401

        return True
    except Exception as exc:  # ImportError, or a broken install surfacing as anything else
        logger.debug("triton not usable: %s", exc)
        return False


def triton_interpreter_problem() -> str | None:
    """Why Triton's interpreter (the kernel on CPU tensors, ``TRITON_INTERPRET=1``) cannot run here,
    or None: interpreters before Triton 3.7 call int() on 1-element arrays, which NumPy 2.4 refuses."""
    import numpy
    import triton

    old_triton = tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7)
    new_numpy = tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4)
    if old_triton and new_numpy:
        return f"triton {triton.__version__}'s interpreter predates NumPy 2.4 support (numpy {numpy.__version__})"
    return None


def _flash_attn_params() -> frozenset[str]:
    """The arguments of flash-attn's ``flash_attn_varlen_func`` (empty: not importable). A wheel
    built for another torch fails at import (undefined symbol) or at first attribute access:
    either way we fall back, never crash."""
    try:
        from flash_attn import flash_attn_varlen_func

        return frozenset(inspect.signature(flash_attn_varlen_func).parameters)
    except Exception as exc:  # ImportError, OSError, an ABI error surfacing as anything else
        logger.debug("flash-attn not usable: %s", exc)
        return frozenset()


def _flash_attn_importable() -> bool:
    """flash-attn with a paged varlen kernel."""
    return "block_table" in _flash_attn_params()


def _softcap_problem(name: str) -> str | None:
    """Why an installed FlashAttention backend cannot cap attention scores (None: it can, or it
    is not installed, which the caller reports): flash-attn's ``softcap`` came in 2.6."""
    if name == "flash_attn" and _flash_attn_importable() and "softcap" not in _flash_attn_params():
        return "this flash-attn's flash_attn_varlen_func takes no softcap (flash-attn >= 2.6 does)"
    varlen = torch_varlen_backend() if name == "torch_varlen" else None
    if varlen is not None and not varlen.supports_softcap:
        return f"torch {torch.__version__}'s varlen_attn takes no softcap"
    return None


def _sinks_problem(name: str) -> str | None:
    """Why a FlashAttention backend cannot add attention sinks to its softmax (gpt-oss's): flash-attn 2.x
    has no such argument, nor has torch's varlen_attn (2.13's), so our glue passes none."""
    if name == "flash_attn":
        return "flash-attn 2's flash_attn_varlen_func takes no attention sinks"
    if name == "torch_varlen":
        return f"torch {torch.__version__}'s varlen_attn takes no attention sinks"
    return None


def _model_problems(name: str, softcap: float | None, sinks: bool) -> list[str]:
    """What of the model's attention backend ``name`` cannot compute: a score cap, sinks (empty: all of it)."""
    problems = []
    if softcap is not None and (problem := _softcap_problem(name)):
        problems.append(f"the model caps its attention scores (attn_logit_softcapping={softcap}) and {problem}")
    if sinks and (problem := _sinks_problem(name)):
        problems.append(f"the model has attention sinks (a learned softmax logit per head, gpt-oss) and {problem}")
    return problems


def _fused_choice(softcap: float | None, sinks: bool = False) -> str | None:
    """flash-attn, else torch's varlen FlashAttention, whichever is installed (and caps scores,
    for a model with ``softcap``, and has ``sinks``); None, with the reason logged, when neither can run."""
    flash, unable = _flash_attn_importable(), []
    for name, installed in (("flash_attn", flash), ("torch_varlen", torch_varlen_backend() is not None)):
        if not installed:
            continue
        if problems := _model_problems(name, softcap, sinks):
            unable += problems
            continue
        if name == "torch_varlen" and not flash:
            logger.warning("flash-attn is not importable with this torch; using torch's varlen FlashAttention")
        return name
    if unable:
        logger.info("FlashAttention backends skipped: %s", "; ".join(dict.fromkeys(unable)))
    else:
        logger.warning("flash-attn is not importable and torch %s's varlen_attn cannot read a paged cache",
                       torch.__version__)  # fmt: skip
    return None


def _fused_problems(
    name: str, device: torch.device, dtype: torch.dtype, block_size: int, cache_dtype: torch.dtype
) -> list[str]:
    """Why a FlashAttention backend cannot run this configuration (empty: it can)."""
    problems = []
    if device.type != "cuda":
        problems.append("it needs a CUDA device")
    if block_size % FLASH_BLOCK_MULTIPLE:
        problems.append(
            f"its paged kernel needs block_size to be a multiple of {FLASH_BLOCK_MULTIPLE} (got {block_size})"
        )
    if dtype not in (torch.float16, torch.bfloat16):
        problems.append(f"it supports float16/bfloat16 only (got {dtype}; use dtype='bfloat16' or 'auto')")
    if cache_dtype != dtype:  # (flash-attn 2 and torch's kernel read K/V in q's dtype; no fp8 there)
        problems.append(f"it reads the KV cache in the model's dtype only (the cache holds {cache_dtype}: "
                        "kv_cache_dtype other than 'auto' needs the triton or torch backend)")  # fmt: skip
    return problems


def select_backend(
    requested: str | None, device: torch.device, dtype: torch.dtype, block_size: int,
    cache_dtype: torch.dtype | None = None, softcap: float | None = None, sinks: bool = False,
) -> str:  # fmt: skip
    """The backend for this engine (``cache_dtype``: what the KV cache holds, None: ``dtype``;
    ``softcap``: the model caps its attention scores, Gemma 2's attn_logit_softcapping; ``sinks``: its
    softmax has a learned logit per head, gpt-oss's attention sinks).
    ``requested`` (EngineArgs.attention_backend) is validated: a configuration it cannot run is a
    ValueError naming the backend and the constraint.
    Auto on CUDA: flash-attn when importable, else torch's varlen FlashAttention when its schema
    reads a paged cache (both only for fp16/bf16 and block sizes that are multiples of 256, and,
    with a softcap, only when their call takes one, and never with sinks: else skipped with the
    reason logged), else our Triton kernel when triton imports, else the torch backend (SDPA over
    gathered blocks).
    On CPU: the cpu backend (its C decode kernel) for float32 and bfloat16, else (float16) the
    torch backend. Every backend caps scores but flash-attn < 2.6 and a torch whose varlen_attn
    takes no softcap (2.13's); the torch, cpu and triton backends have sinks, the FlashAttention ones not."""
    if requested is not None and requested not in BACKEND_NAMES:
        raise ValueError(f"attention_backend={requested!r} is not one of {list(BACKEND_NAMES)}")
    cache_dtype = cache_dtype or dtype
    if requested is not None and (problems := _model_problems(requested, softcap, sinks)):
        raise ValueError(f"attention_backend={requested!r} cannot be used: " + "; ".join(problems))
    if requested == "cpu":
        problems = [] if device.type == "cpu" else [f"it runs on the CPU (device is {device.type})"]
        if dtype not in MODEL_DTYPES:
            problems.append(f"its decode kernel takes float32 or bfloat16 only (got {dtype}; use dtype='auto')")
        if problems:
            raise ValueError("attention_backend='cpu' cannot be used: " + "; ".join(problems))
        return "cpu"
    if requested is None and device.type == "cpu":
        return "cpu" if dtype in MODEL_DTYPES else "torch"
    if requested == "torch" or (requested is None and device.type != "cuda"):
        return "torch"
    if requested == "triton":
        if device.type != "cuda":
            raise ValueError("attention_backend='triton' cannot be used: it needs a CUDA device")
        if not _triton_importable():
            raise ValueError("attention_backend='triton' but triton is not importable (pip install triton)")
        return "triton"
    if requested is not None:
        problems = _fused_problems(requested, device, dtype, block_size, cache_dtype)
        if problems:
            raise ValueError(f"attention_backend={requested!r} cannot be used: " + "; ".join(problems))
        if requested == "flash_attn" and not _flash_attn_importable():
            raise ValueError("attention_backend='flash_attn' but flash-attn (with block_table) is not importable")
        if requested == "torch_varlen" and torch_varlen_backend() is None:
            fallback = "triton" if _triton_importable() else "torch"
            logger.warning("torch %s has no paged varlen_attn (block_table/seqused_k); using the %s backend",
                           torch.__version__, fallback)  # fmt: skip
            return fallback
        return requested
    problems = _fused_problems("flash_attn", device, dtype, block_size, cache_dtype)
    if problems:
        logger.info("FlashAttention backends skipped: %s", "; ".join(problems))
    elif (fused := _fused_choice(softcap, sinks)) is not None:
        return fused
    if dtype == torch.float32 and cache_dtype.itemsize == 1:  # (forced, it runs: correct, slower)
        logger.info("a float32 model over an fp8 KV cache: the torch backend (the Triton kernel's float32 tiles "
                    "spill registers widening fp8: bench/triton_compile_check.py)")  # fmt: skip
        return "torch"
    if _triton_importable():
        logger.info("using the Triton paged-attention kernel")
        return "triton"
    logger.warning("triton is not importable; using the torch backend (SDPA over gathered blocks)")
    return "torch"
