"""Start-up check of an attention backend against the torch path, on the model's own shapes.

A kernel that imports can still fail where it first runs: a Triton kernel compiles at its
first launch (a toolchain or driver mismatch raises there), and a miscompiled one returns
wrong numbers without raising. Running every kind of launch the engine will make (prompts
without a cache, a mixed prefill/decode step over the paged cache, a decode-only step) on a
small scratch cache, before any request, turns both into a start-up decision: the engine
falls back to the torch backend with one warning instead of failing mid-request. The
kernels it compiles are the ones the engine then uses, so the check costs no extra compiles.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from vllmini.kv.cache_dtype import round_to_cache, to_cache
from vllmini.models.attention import torch_attention
from vllmini.models.backend_select import get_backend, select_backend
from vllmini.models.base import AttentionMetadata, slot_of

logger = logging.getLogger("vllmini")
AttentionFn = Callable[..., torch.Tensor]


def start_backend(
    requested: str | None, device: torch.device, dtype: torch.dtype, block_size: int,
    num_heads: int, num_kv_heads: int, head_dim: int, window: int | None = None, cache_dtype: torch.dtype | None = None,
    softcap: float | None = None, sinks: bool = False,
) -> tuple[str, AttentionFn]:  # fmt: skip
    """The engine's backend: ``select_backend``'s choice once it has passed ``check_backend``
    (``cache_dtype``: what the KV cache holds, None: ``dtype``; ``softcap``: the model's attention
    score cap, which the check applies too; ``sinks``: the model has attention sinks, which the check
    gives random values).
    A chosen backend that fails falls back to the torch one with a warning; a forced one
    (``EngineArgs.attention_backend``) that fails is a ValueError naming it and the failure."""
    name = select_backend(requested, device, dtype, block_size, cache_dtype, softcap, sinks)
    fn = get_backend(name)
    if name == "torch":
        return name, fn
    problem = check_backend(fn, device, dtype, num_heads, num_kv_heads, head_dim, block_size, window, cache_dtype,
                            softcap, sinks)  # fmt: skip
    if problem is None:
        return name, fn
    if requested == name:
        raise ValueError(f"attention_backend={name!r} failed its start-up check: {problem}")
    logger.warning("attention backend %s failed its start-up check (%s); using the torch backend", name, problem)
    return "torch", torch_attention


def _steps(block_size: int) -> list[tuple[list[int], list[int]]]:
    """(query lengths, context lengths) per step: a mixed step (decode rows, a chunk after
    cached tokens, a fresh prompt), then a decode-only step over a context longer than one block
    (two rows over 2 blocks + 1 token: on a GPU the Triton backend splits their keys)."""
    return [([1, 5, 3, 1], [block_size + 3, 9, 3, 1]), ([1, 1], [2 * block_size + 1, 7])]


@torch.inference_mode()
def check_backend(
    backend: AttentionFn,
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    window: int | None = None,
    cache_dtype: torch.dtype | None = None,
    softcap: float | None = None,
    sinks: bool = False,
) -> str | None:
    """None when ``backend`` matches the torch path on every kind of step, else why not; with a
    model that slides (``window``), each step is also run with a window shorter than its
    contexts (the value does not matter to a kernel, the masking does). The caches hold
    ``cache_dtype`` (None: ``dtype``), and the new K/V come in it, as ``Attention`` passes them.
    ``softcap``: both cap their scores (passed only when set, as ``Attention`` passes it); ``sinks``: both
    get the same random sink logits, large enough to take a good share of each softmax."""
    cache_dtype = cache_dtype or dtype
    options: dict = {} if softcap is None else {"softcap": softcap}  # (the model's, as Attention passes them)
    g = torch.Generator().manual_seed(0)
    if sinks:
        options["sinks"] = (torch.randn(num_heads, generator=g) + 2).to(device=device, dtype=dtype)
    scale = head_dim**-0.5
    tol = 1e-3 if dtype == torch.float32 else 3e-2

    def qkv(tokens: int) -> list[torch.Tensor]:
        shapes = ((tokens, num_heads, head_dim), (tokens, num_kv_heads, head_dim), (tokens, num_kv_heads, head_dim))
        q, k, v = [torch.randn(*shape, generator=g).to(device=device, dtype=dtype) for shape in shapes]
        return [q, round_to_cache(k, cache_dtype), round_to_cache(v, cache_dtype)]

    windows = [None] if window is None else [None, 4]
    try:
        problems = []
        for w in windows:
            lens = [5, 1, 17]
            q, k, v = qkv(sum(lens))
            got = backend(q, k, v, AttentionMetadata.for_prompts(lens, device), None, scale, w, **options)
            want = torch_attention(q, k, v, AttentionMetadata.for_prompts(lens, device), None, scale, w, **options)
            problems += _compare(f"prompts without a cache{_windowed(w)}", got, want, tol)
        for (q_lens, seq_lens), w in ((step, w) for step in _steps(block_size) for w in windows):
            blocks = [-(-n // block_size) for n in seq_lens]
            tables = [list(range(sum(blocks[:i]), sum(blocks[: i + 1]))) for i in range(len(blocks))]
            cache = [to_cache(torch.randn(sum(blocks), block_size, num_kv_heads, head_dim, generator=g).to(device),
                              cache_dtype) for _ in range(2)]  # fmt: skip
            slots = [slot_of(t, p, block_size) for t, n, ql in zip(tables, seq_lens, q_lens) for p in range(n - ql, n)]
            q, k, v = qkv(sum(q_lens))
            k, v = to_cache(k, cache_dtype), to_cache(v, cache_dtype)  # as Attention.forward passes them
            got, want = (
                fn(q, k, v, AttentionMetadata.paged(q_lens, seq_lens, slots, tables, device=device),
                   tuple(c.clone() for c in cache), scale, w, **options)
                for fn in (backend, torch_attention)
            )  # fmt: skip
            what = "decode-only step" if max(q_lens) == 1 else "mixed prefill/decode step"
            problems += _compare(what + _windowed(w), got, want, tol)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:  # a compile error, a launch failure, a driver error: the finding
        return f"{type(exc).__name__}: {str(exc)[:300]}"
    return "; ".join(problems) or None


def _windowed(window: int | None) -> str:
    return "" if window is None else f" (sliding window {window})"


def _compare(what: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> list[str]:
    err = (got.float() - want.float()).abs().max().item()
    bound = tol * max(want.float().abs().max().item(), 1.0)
    return [] if err <= bound else [f"{what}: max |diff| {err:.3g} vs the torch path (tolerance {bound:.3g})"]
