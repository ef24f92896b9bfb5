"""The torch backend's attention math for one call: SDPA, or, for a model that caps its scores
(Gemma 2's ``attn_logit_softcapping``, which SDPA cannot), transformers' eager math; a prefill chunk
takes the eager math a tile of query rows at a time (``capped_prefill``), so that its scores stay
bounded however long the context behind it is.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float | None = None,
           **sdpa: Any) -> torch.Tensor:  # fmt: skip
    """SDPA (``sdpa``: its attn_mask / is_causal / enable_gqa), or, with ``softcap``, the eager math
    transformers' Gemma 2 runs (SDPA has no cap): ``softcap * tanh(scores / softcap)``, then the
    mask, a float32 softmax and the values (in place where it can: the scores are the big tensor)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, **sdpa)
    if k.shape[-3] != q.shape[-3]:  # grouped-query heads ([H, L, D] rows: enable_gqa)
        k, v = (t.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3) for t in (k, v))
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).div_(softcap).tanh_().mul_(softcap)
    mask = sdpa.get("attn_mask")
    if sdpa.get("is_causal"):
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def causal_mask(q_range: tuple[int, int], k_range: tuple[int, int], window: int | None,
                device: torch.device) -> torch.Tensor:  # fmt: skip
    """``[queries, keys]`` True where the query at a position in ``q_range`` (start, end) sees the key
    at one in ``k_range``: at or before it, and within its last ``window`` positions when given."""
    pos_q = torch.arange(*q_range, device=device)[:, None]
    pos_k = torch.arange(*k_range, device=device)[None, :]
    return pos_k <= pos_q if window is None else (pos_k <= pos_q) & (pos_k > pos_q - window)


# Most scores (query rows x keys x heads) one tile of the capped prefill holds: 16 MiB in float32.
SOFTCAP_TILE_SCORES = 2**22


def capped_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float, q_first: int, k_first: int,
    window: int | None,
) -> torch.Tensor:  # fmt: skip
    """Capped causal attention of a chunk, ``q [1, H, q_len, D]`` at positions ``q_first...`` over
    ``k/v [1, Hkv, L, D]`` at ``k_first...``, a tile of query rows at a time. SDPA has no cap, so the
    eager math builds the scores; in one piece they were q_len x L x H (a chunk after a long cached
    context: far more than the warm-up's prompts built, which the CUDA KV budget is measured on).
    A tile holds at most ``SOFTCAP_TILE_SCORES`` scores, and never more than the chunk would as a
    whole prompt (q_len x q_len x H, as the warm-up's prompts do), so no step outgrows the
    warm-up; each tile reads only the keys its rows can see (causal, window). One tile, as
    short chunks take, is the single call it was."""
    heads, q_len, length = q.shape[1], q.shape[2], k.shape[2]
    if k.shape[1] != heads:  # grouped-query heads, repeated once for every tile
        k, v = (t.repeat_interleave(heads // k.shape[1], dim=1) for t in (k, v))
    rows = max(1, min(q_len, min(q_len * q_len, SOFTCAP_TILE_SCORES // heads) // length))
    out = torch.empty_like(q)
    for r0 in range(0, q_len, rows):
        r1 = min(r0 + rows, q_len)
        lo = 0 if window is None else max(0, q_first + r0 - window + 1 - k_first)  # the tile's first key
        hi = q_first + r1 - k_first  # one past its last
        mask = causal_mask((q_first + r0, q_first + r1), (k_first + lo, k_first + hi), window, q.device)
        out[:, :, r0:r1] = attend(q[:, :, r0:r1], k[:, :, lo:hi], v[:, :, lo:hi], scale, softcap, attn_mask=mask)
    return out
