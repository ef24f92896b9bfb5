"""The torch backend's attention math for one call: SDPA, or, for a model that caps its scores
(Gemma 2's ``attn_logit_softcapping``, which SDPA cannot) or has attention sinks (gpt-oss: a learned
logit per query head that joins the softmax as a column whose value row is zero), transformers' eager
math; a capped prefill chunk takes the eager math a tile of query rows at a time (``capped_prefill``),
so that its scores stay bounded however long the context behind it is. A prefill chunk with sinks
(uncapped) stays on SDPA's fused kernel with the sink as one more key (``sink_prefill``).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# Finite stand-in for an infinite sink logit (a -inf sink is no sink, +inf all of the softmax) for the eager
# math (inf - inf is NaN) and the C kernel (built with -ffast-math): exp(-1e30 - score) is 0 in float32 as well.
SINK_BOUND = 1e30


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float | None = None,
           sinks: torch.Tensor | None = None, **sdpa: Any) -> torch.Tensor:  # fmt: skip
    """SDPA (``sdpa``: its attn_mask / is_causal / enable_gqa), or, with ``softcap`` or ``sinks``, the
    eager math transformers' Gemma 2 / gpt-oss run (SDPA has neither): ``softcap * tanh(scores / softcap)``,
    then the mask, a float32 softmax with the sink logit as one more column (dropped: its value row is
    zero) and the values (in place where it can: the scores are the big tensor). ``sinks [H]``: one per
    query head, the heads being ``q``'s axis -3 (``[H, rows, D]``) or axes -3 and -2 (decode rows with
    grouped heads folded in: ``[Hkv, G, D]``)."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, **sdpa)
    if k.shape[-3] != q.shape[-3]:  # grouped-query heads ([H, L, D] rows: enable_gqa)
        k, v = (t.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3) for t in (k, v))
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if softcap is not None:
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    mask = sdpa.get("attn_mask")
    if sdpa.get("is_causal"):
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill_(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
    sink = sinks.float().clamp(-SINK_BOUND, SINK_BOUND).view(q.shape[-3], -1, 1)  # (+inf - +inf: NaN)
    scores = scores.float()  # (float32 scores: in place)
    top = torch.maximum(scores.amax(-1, keepdim=True), sink)  # the max over keys and sink: finite
    probs = scores.sub_(top).exp_()
    probs = probs.div_(probs.sum(-1, keepdim=True).add_((sink - top).exp_()))
    return torch.matmul(probs.to(q.dtype), v)


def causal_mask(q_range: tuple[int, int], k_range: tuple[int, int], window: int | None,
                device: torch.device) -> torch.Tensor:  # fmt: skip
    """``[queries, keys]`` True where the query at a position in ``q_range`` (start, end) sees the key
    at one in ``k_range``: at or before it, and within its last ``window`` positions when given."""
    pos_q = torch.arange(*q_range, device=device)[:, None]
    pos_k = torch.arange(*k_range, device=device)[None, :]
    return pos_k <= pos_q if window is None else (pos_k <= pos_q) & (pos_k > pos_q - window)


def prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_first: int, k_first: int, window: int | None,
    softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Causal attention of a prefill chunk, ``q [1, H, q_len, D]`` at positions ``q_first...`` over
    ``k/v [1, Hkv, L, D]`` at ``k_first...`` (lower-right aligned: a chunk after cached tokens), each
    query seeing its last ``window`` positions when given. Uncapped chunks take SDPA's fused kernel
    (4-D inputs: 3-D ones go to its math path, 7x slower at L = 2048), causal when the chunk is the
    whole context, else with a mask."""
    if softcap is not None:  # (eager math: in tiles of query rows)
        return capped_prefill(q, k, v, scale, softcap, q_first, k_first, window, sinks)
    if sinks is not None:
        return sink_prefill(q, k, v, scale, sinks, q_first, k_first, window)
    if _whole_context(q, k, q_first, k_first, window):
        return attend(q, k, v, scale, is_causal=True, enable_gqa=True)
    mask = causal_mask((q_first, q_first + q.shape[2]), (k_first, k_first + k.shape[2]), window, q.device)
    return attend(q, k, v, scale, attn_mask=mask, enable_gqa=True)


def _whole_context(q: torch.Tensor, k: torch.Tensor, q_first: int, k_first: int, window: int | None) -> bool:
    """Whether the chunk's queries are its whole context with no window cutting it: SDPA's causal
    (upper-left aligned) flag then masks it, no mask needed."""
    return q_first == k_first and q.shape[2] == k.shape[2] and (window is None or window >= k.shape[2])


def sink_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sinks: torch.Tensor, q_first: int,
    k_first: int, window: int | None,
) -> torch.Tensor:  # fmt: skip
    """``prefill`` with gpt-oss's sinks, on SDPA's fused kernel: the sink becomes key 0, seen by every
    query, whose value row is zero. Its score must be ``sinks[h]`` whatever the query, so each head's
    queries get an extra dimension holding ``sinks[h] / scale`` and the keys one holding 1 for the sink
    key, 0 for the others (two dimensions, the logit's high and low halves, in a 16-bit dtype: one
    would round the logit to 8 bits). A whole prompt stays causal (SDPA's causal is upper-left aligned:
    a dummy query row 0, which sees only the sink, puts query j at row j + 1, seeing keys 0..j + 1).
    Whole prompts of 512-2048 tokens at gpt-oss-20b's shapes (64 heads of 64 over 8 KV heads), 2 cores:
    1.15-1.18x plain SDPA's time without sinks; eager math in tiles 1.4-2.0x (float32), 0.84-1.9x (bfloat16:
    faster at 512 tokens only); SDPA's private op that returns the log-sum-exp, for a correction of the
    output by sigmoid(lse - sink), 1.06-1.12x (bench/attention_sinks.py)."""
    heads, q_len, dim = q.shape[1], q.shape[2], q.shape[3]
    causal = _whole_context(q, k, q_first, k_first, window)
    extra, rows = (1 if q.dtype == torch.float32 else 2), q_len + causal
    bound = torch.finfo(q.dtype).max / 4  # (finite in q's dtype: float16's 16376 / scale is still exp's 0 or inf)
    logit = (sinks.float() / scale).clamp(-bound, bound)
    halves = [logit.to(q.dtype)]
    if extra == 2:
        halves.append((logit - halves[0].float()).to(q.dtype))
    qa = q.new_zeros(1, heads, rows, dim + extra)
    qa[:, :, causal:, :dim] = q
    qa[0, :, causal:, dim:] = torch.stack(halves, -1)[:, None, :]
    ka, va = (t.new_zeros(1, t.shape[1], t.shape[2] + 1, dim + extra) for t in (k, v))
    ka[:, :, 1:, :dim], va[:, :, 1:, :dim] = k, v
    ka[:, :, 0, dim:] = 1.0
    if causal:
        out = F.scaled_dot_product_attention(qa, ka, va, scale=scale, is_causal=True, enable_gqa=True)
        return out[:, :, 1:, :dim]
    mask = causal_mask((q_first, q_first + q_len), (k_first - 1, k_first + k.shape[2]), window, q.device)
    mask[:, 0] = True  # (the sink's column)
    return F.scaled_dot_product_attention(qa, ka, va, attn_mask=mask, scale=scale, enable_gqa=True)[..., :dim]


# Most scores (query rows x keys x heads) one tile of the capped prefill holds: 16 MiB in float32.
SOFTCAP_TILE_SCORES = 2**22


def capped_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float | None, q_first: int, k_first: int,
    window: int | None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Capped causal attention of a chunk, ``q [1, H, q_len, D]`` at positions ``q_first...`` over
    ``k/v [1, Hkv, L, D]`` at ``k_first...``, a tile of query rows at a time. SDPA has no cap, so the
    eager math builds the scores; in one piece they were q_len x L x H (a chunk after a long cached
    context: far more than the warm-up's prompts built, which the CUDA KV budget is measured on).
    A tile holds at most ``SOFTCAP_TILE_SCORES`` scores, and never more than the chunk would as a
    whole prompt (q_len x q_len x H, as the warm-up's prompts do), so no step outgrows the
    warm-up; each tile reads only the keys its rows can see (causal, window). One tile, as
    short chunks take, is the single call it was. ``sinks``: each tile's softmax has them too (with no
    ``softcap``, the eager alternative to ``sink_prefill`` that bench/attention_sinks.py times)."""
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
        out[:, :, r0:r1] = attend(q[:, :, r0:r1], k[:, :, lo:hi], v[:, :, lo:hi], scale, softcap, sinks,
                                  attn_mask=mask)  # fmt: skip
    return out
