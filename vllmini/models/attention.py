"""Attention over a varlen batch, with or without a paged KV cache.

Backends share one signature ``(q, k, v, meta, kv_cache, scale, window=None) -> out`` and one
metadata object (``window``: sliding-window attention, each query attends to the ``window``
latest positions up to its own, as transformers' Mistral/Qwen2/Phi-3; None: all of them); models/backend_select.py picks one at start-up: ``flash_attn`` (the
flash-attn package), ``torch_varlen`` (torch's built-in FlashAttention, ``varlen_attn`` with
a block table), ``triton`` (our paged kernel, models/triton_attention.py), ``cpu`` (the torch
backend with a C decode kernel, models/cpu_attention.py) or ``torch`` (below). The first three
read K/V straight from the paged cache and are graph-safe as they are; the torch backend has
a separate static-shape path for decode steps replayed from a CUDA graph (``meta.static_decode``).
With a cache, ``k``/``v`` come in the cache's dtype (``Attention.forward`` casts them once: an
fp8 cache's bytes are then copied, not cast again); a backend widens what it attends to itself.

The pure-PyTorch backend (any device):
- the new K/V are written into the cache with one indexed copy at ``slot_mapping``;
- single-token (decode) rows attend in a few SDPA calls, one per group of similar context
  lengths, over their gathered blocks (one gather per group, a padding mask, GQA by folding
  query heads into the query-length axis so no K/V repeat is needed), or all in one call
  of a ``decode`` kernel that reads the paged cache itself (the cpu backend's);
- multi-token rows (prefill chunks) attend per sequence with a lower-right causal mask.
With a ``softcap`` (Gemma 2) the scores are capped, and with ``sinks`` (gpt-oss: a learned logit per
query head joins the softmax, its value row zero) the softmax has them, by whichever backend can
(backend_select.py picks among those); the torch backend's math for them is models/eager_attention.py.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Callable

import torch
from torch import nn

from vllmini.kv.cache_dtype import indexable, to_cache
from vllmini.models.base import AttentionMetadata
from vllmini.models.eager_attention import attend, prefill


KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, num_kv_heads, head_dim]


@dataclass
class _DecodeGroup:
    """Single-token rows of similar context length, attended in one SDPA call."""

    rows: torch.Tensor  # [Bd] flat query rows
    block_tables: torch.Tensor  # [Bd, nb]
    seq_lens: torch.Tensor  # [Bd] int32
    mask: torch.Tensor | None  # [Bd, 1, 1, nb * block_size] True = attend (gather + SDPA only)
    lens_cpu: list[int] = field(default_factory=list)  # seq_lens as host ints (gather + SDPA only)
    # window -> (its mask, the flat [Bd * nb * block_size] gathered positions it hides), made once a step
    hidden: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass
class _TorchPlan:
    """Per-forward work split, computed once and shared by every layer."""

    q_starts: list[int]
    prefill_seqs: list[int]  # sequences attended one by one
    decode_groups: list[_DecodeGroup]


# Fixed cost of one more decode group (gather, SDPA, scatter per layer), in gathered
# row-blocks; measured on the 2-core CPU (see _decode_groups).
DECODE_GROUP_COST_BLOCKS = 16


def _decode_groups(num_blocks: list[int], group_cost: int = DECODE_GROUP_COST_BLOCKS) -> list[list[int]]:
    """Split decode rows into groups, each padded to its longest member.

    Decode attention is memory-bound on the K/V gather, so padding every row to the longest
    context wastes bytes (mixed lengths: often half); each extra group costs a few more
    small ops per layer. Rows sorted by length are cut into runs minimising
    ``sum(rows x longest) + group_cost x groups`` (exact DP, once per step): long mixed
    contexts split, short or similar ones stay together. Rows of equal length never gain
    from being split, so the DP runs over the distinct lengths (at most max_model_len /
    block_size of them), not over the rows."""
    order = sorted(range(len(num_blocks)), key=num_blocks.__getitem__)
    lens = sorted(set(num_blocks))
    rank = {n: i for i, n in enumerate(lens)}
    counts = [0] * (len(lens) + 1)  # counts[j]: rows with one of the j shortest lengths
    for n in num_blocks:
        counts[rank[n] + 1] += 1
    for j in range(1, len(counts)):
        counts[j] += counts[j - 1]
    best, cut = [0] + [math.inf] * len(lens), [0] * (len(lens) + 1)
    for j in range(1, len(lens) + 1):  # best[j]: cheapest split of the rows of the j shortest lengths
        for i in range(j):  # last group = lengths i..j-1, padded to lens[j - 1]
            cost = best[i] + (counts[j] - counts[i]) * lens[j - 1] + group_cost
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(lens)
    while j:
        groups.append(order[counts[cut[j]] : counts[j]])
        j = cut[j]
    return groups[::-1]


def _plan(meta: AttentionMetadata, block_size: int | None, grouped: bool = True) -> _TorchPlan:
    """Decode rows in length groups for gather + SDPA (``grouped``), else all in one group
    with int32 tables and no mask (a kernel that reads the paged cache needs no padding)."""
    q_starts = [0, *accumulate(meta.query_lens_cpu)]
    paged = block_size is not None and meta.block_tables is not None
    decode = [i for i, q in enumerate(meta.query_lens_cpu) if q == 1 and paged]
    prefill = [i for i, q in enumerate(meta.query_lens_cpu) if not (q == 1 and paged)]
    groups = []
    device = meta.seq_lens.device
    blocks_needed = [-(-meta.seq_lens_cpu[i] // block_size) for i in decode]
    if grouped:
        member_lists = _decode_groups(blocks_needed)
    else:
        member_lists = [list(range(len(decode)))] if decode else []
    for members in member_lists:
        seqs = [decode[j] for j in members]
        idx = torch.tensor(seqs, dtype=torch.long, device=device)
        num_blocks = max(blocks_needed[j] for j in members)
        tables = meta.block_tables.index_select(0, idx)[:, :num_blocks]
        lens = meta.seq_lens.index_select(0, idx)
        rows = torch.tensor([q_starts[i] for i in seqs], dtype=torch.long, device=device)
        if not grouped:
            groups.append(_DecodeGroup(rows, tables.contiguous(), lens, None))
            continue
        mask = torch.arange(num_blocks * block_size, device=device)[None, :] < lens[:, None]
        lens_cpu = [meta.seq_lens_cpu[i] for i in seqs]
        groups.append(_DecodeGroup(rows, tables.long(), lens, mask[:, None, None, :], lens_cpu))
    return _TorchPlan(q_starts, prefill, groups)


def gather_blocks(cache: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``cache [num_blocks, bs, Hkv, D]`` rows of ``tables [B, nb]`` -> ``[B, nb * bs, Hkv, D]``
    in ``dtype`` (the cache's own, or wider: an fp8 cache is read in the model's dtype).
    One ``index_select`` over the flattened table: on CPU 2-3x faster than advanced indexing
    (``cache[tables]``), which is most of the cost of decode attention there."""
    batch, num_blocks = tables.shape
    out = indexable(cache).index_select(0, tables.reshape(-1))
    return out.view(cache.dtype).view(batch, num_blocks * cache.shape[1], *cache.shape[2:]).to(dtype)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V at their slots (one indexed copy per tensor), in the cache's
    dtype (``Attention.forward`` has cast them to it already: then ``.to`` is no copy); fp8 is
    copied as its bytes (``indexable``). One cache tensor for both (MLA's latent, whose values
    are its keys: models/mla.py) is written once, with ``k``."""
    pairs = ((k, kv_cache[0]),) if kv_cache[1] is kv_cache[0] else tuple(zip((k, v), kv_cache))
    for new, cache in pairs:
        indexable(cache).view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, indexable(new.to(cache.dtype)))


def torch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    kv_cache: KVCache | None,
    scale: float,
    window: int | None = None,
    decode: Callable[..., torch.Tensor] | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [T, H, D]``, ``k/v [T, Hkv, D]`` -> ``[T, H, D]``. ``decode``, when given, attends all
    decode rows in one call, straight from the paged cache: ``decode(q [Bd, Hkv, G, D], k_cache,
    v_cache, block_tables [Bd, nb] int32, seq_lens [Bd] int32, scale, window, softcap, sinks)`` (the cpu
    backend). ``softcap``: scores capped to (-softcap, softcap) (Gemma 2). ``sinks [H]``: gpt-oss's."""
    block_size = kv_cache[0].shape[1] if kv_cache is not None else None
    if kv_cache is not None and meta.slot_mapping is not None:
        write_kv(k, v, kv_cache, meta.slot_mapping)
    if meta.static_decode:
        return _static_decode(q, meta, kv_cache, scale, window, softcap, sinks)
    plan = meta.backend_plan
    if plan is None:
        plan = meta.backend_plan = _plan(meta, block_size, grouped=decode is None)
    out = torch.empty_like(q)
    num_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]

    for group in plan.decode_groups:
        k_cache, v_cache = kv_cache
        bd = group.block_tables.shape[0]
        qd = q.index_select(0, group.rows).view(bd, num_kv_heads, num_heads // num_kv_heads, head_dim)
        if decode is not None:
            od = decode(qd, k_cache, v_cache, group.block_tables, group.seq_lens, scale, window, softcap, sinks)
        else:  # one gather per group: [Bd, L, Hkv, D], read by SDPA as [Bd, Hkv, L, D]
            mask, hidden = _hidden_positions(group, window)
            keys = gather_blocks(k_cache, group.block_tables, q.dtype)
            vals = keys if v_cache is k_cache else gather_blocks(v_cache, group.block_tables, q.dtype)  # (MLA: one)
            for gathered in (keys,) if vals is keys else (keys, vals):  # fresh gathers: zeroed in place (_zero_masked)
                gathered.view(-1, num_kv_heads * head_dim).index_fill_(0, hidden, 0.0)
            od = attend(qd, keys.transpose(1, 2), vals.transpose(1, 2), scale, softcap, sinks, attn_mask=mask)
        out.index_copy_(0, group.rows, od.reshape(bd, num_heads, head_dim))

    for i in plan.prefill_seqs:
        start, q_len, seq_len = plan.q_starts[i], meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
        first = 0  # the first key position read: with a window, from the block its earliest query sees
        if kv_cache is None or q_len == seq_len:  # nothing cached before this chunk: no gather needed
            keys, vals = k[start : start + q_len].to(q.dtype), v[start : start + q_len].to(q.dtype)
        else:
            if window is not None:
                first = max(0, seq_len - q_len - window + 1) // block_size * block_size
            blocks = meta.block_tables[i, first // block_size : -(-seq_len // block_size)].long()
            keys = gather_blocks(kv_cache[0], blocks[None], q.dtype)[0, : seq_len - first]
            if kv_cache[1] is kv_cache[0]:  # (MLA's latent: its keys are its values)
                vals = keys
            else:
                vals = gather_blocks(kv_cache[1], blocks[None], q.dtype)[0, : seq_len - first]
        # [1, H, L, D] (4-D: SDPA's fused CPU kernel); query j sits at absolute position seq_len - q_len + j
        qi = q[start : start + q_len].transpose(0, 1)[None]
        keys, vals = keys.transpose(0, 1)[None], vals.transpose(0, 1)[None]
        oi = prefill(qi, keys, vals, scale, seq_len - q_len, first, window, softcap, sinks)
        out[start : start + q_len] = oi[0].transpose(0, 1)
    return out


def _static_decode(
    q: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache, scale: float, window: int | None,
    softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """One token per row over ALL ``block_tables`` columns, masked by the ``seq_lens`` tensor:
    fixed shapes, no host lists, no device->host sync, so a CUDA graph can capture it."""
    k_cache, v_cache = kv_cache
    batch, num_blocks = meta.block_tables.shape
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    tables = meta.block_tables.long()
    keys = gather_blocks(k_cache, tables, q.dtype).transpose(1, 2)
    vals = gather_blocks(v_cache, tables, q.dtype).transpose(1, 2)
    pos = torch.arange(num_blocks * block_size, device=q.device)[None, :]
    mask = pos < meta.seq_lens[:, None]
    if window is not None:
        mask = mask & (pos >= meta.seq_lens[:, None] - window)
    qd = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    keys, vals = _zero_masked(keys, vals, mask[:, None, None, :])
    out = attend(qd, keys, vals, scale, softcap, sinks, attn_mask=mask[:, None, None, :])
    return out.reshape(batch, num_heads, head_dim)


def _hidden_positions(group: _DecodeGroup, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's attention mask with ``window`` applied (a row's query sits at seq_len - 1: keys
    from seq_len - window), and the flat indices of the gathered token positions it hides, which
    are zeroed with one ``index_fill_`` per tensor (see ``_zero_masked``). A broadcast
    ``masked_fill_`` over the gathered K/V took as long as the gather itself on the CPU (14% of
    the torch backend's mixed workload); this fill writes only the hidden rows. Made once a step
    per window, from host ints (no device sync), and shared by every layer."""
    if window not in group.hidden:
        mask = group.mask
        length = mask.shape[-1]
        pos, lens = torch.arange(length), torch.tensor(group.lens_cpu)[:, None]
        hide = pos >= lens
        if window is not None:
            mask = mask & (pos.to(mask.device) >= group.seq_lens[:, None, None, None] - window)
            hide |= pos < lens - window
        group.hidden[window] = (mask, hide.view(-1).nonzero().view(-1).to(mask.device))
    return group.hidden[window]


def _zero_masked(keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero the gathered K/V (``[B, Hkv, L, D]``) where ``mask`` (``[B, 1, 1, L]``) hides them.
    Masked slots hold whatever their block's last owner left (a reused block's tail, another
    sequence's block in a padded table column); were that NaN or inf, the masked softmax
    weight 0 times it is still NaN, and one request's NaN would reach others."""
    hidden = ~mask.transpose(-1, -2)  # [B, 1, L, 1]
    return keys.masked_fill_(hidden, 0.0), vals.masked_fill_(hidden, 0.0)  # (fresh gathers: in place)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    kv_cache: KVCache | None,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """flash-attn 2.x: one varlen call for the whole mixed prefill/decode batch, reading
    K/V straight from the paged cache through ``block_table`` (causal is lower-right
    aligned there, which is what a chunk after cached tokens needs; a sliding window is its
    ``window_size`` of ``window - 1`` keys to the left; ``softcap`` its own argument, flash-attn
    >= 2.6, which backend_select.py checks for before it picks this backend for a capped model)."""
    from flash_attn import flash_attn_varlen_func

    options = {"window_size": (window - 1, 0)} if window is not None else {}
    if softcap is not None:
        options["softcap"] = softcap
    if kv_cache is None:
        return flash_attn_varlen_func(
            q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_q, meta.max_seqlen_q, meta.max_seqlen_q,
            softmax_scale=scale, causal=True, **options,
        )  # fmt: skip
    write_kv(k, v, kv_cache, meta.slot_mapping)
    return flash_attn_varlen_func(
        q, kv_cache[0], kv_cache[1], meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
        softmax_scale=scale, causal=True, block_table=meta.block_tables, **options,
    )  # fmt: skip


AttentionBackend = Callable[..., torch.Tensor]
_VARLEN_PAGED_ARGS = frozenset({"scale", "window_size", "enable_gqa", "seqused_k", "block_table"})


def torch_varlen_backend(varlen_attn: Callable[..., torch.Tensor] | None = None) -> AttentionBackend | None:
    """torch's own FlashAttention (``torch.nn.attention.varlen.varlen_attn``) bound into our
    backend signature, or None when the installed torch lacks it or its paged arguments
    (``block_table``/``seqused_k``/``enable_gqa``, torch >= 2.12-ish): its schema is read once
    here, at start-up, instead of failing inside a forward. ``varlen_attn`` may be a stand-in
    (tests). The bound function's ``supports_softcap``: the schema has a ``softcap`` argument
    (torch 2.13's has none), which a capped model (Gemma 2) needs."""
    if varlen_attn is None:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            return None
    try:
        params = set(inspect.signature(varlen_attn).parameters)
    except (TypeError, ValueError):
        return None
    if not _VARLEN_PAGED_ARGS <= params:
        return None
    fn, supports_softcap = varlen_attn, "softcap" in params

    def torch_varlen_attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache | None,
        scale: float, window: int | None = None, softcap: float | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """One varlen call for the whole mixed batch; causal is (-1, 0) windowing, aligned to the
        bottom-right like flash-attn's, which a chunk after cached tokens needs. With one query
        per sequence causal == full, and full attention lets the kernel pack GQA heads. A sliding
        window keeps ``window - 1`` keys to the left."""
        left = -1 if window is None else window - 1
        sizes = (left, -1) if meta.max_seqlen_q == 1 else (left, 0)
        common = {"scale": scale, "window_size": sizes, "enable_gqa": True}
        if softcap is not None:
            if not supports_softcap:
                raise ValueError("this torch's varlen_attn takes no softcap")
            common["softcap"] = softcap
        if kv_cache is None:
            cu, n = meta.cu_seqlens_q, meta.max_seqlen_q
            return fn(q, k, v, cu, cu, n, n, **common)
        write_kv(k, v, kv_cache, meta.slot_mapping)
        return fn(
            q, kv_cache[0], kv_cache[1], meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
            seqused_k=meta.seq_lens, block_table=meta.block_tables, **common,
        )  # fmt: skip

    torch_varlen_attention.supports_softcap = supports_softcap
    return torch_varlen_attention


class Attention(nn.Module):
    """Multi-head attention core (no projections): rotary-embedded q/k/v in, context out."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, window: int | None = None,
                 softcap: float | None = None) -> None:  # fmt: skip
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.window = window  # sliding-window attention (None: full)
        self.softcap = softcap  # tanh cap on the scores (Gemma 2), passed to the backend when set
        self.backend: AttentionBackend = torch_attention

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``sinks``: the layer's learned sink logits ``[num_heads]`` (gpt-oss), passed to the backend when set."""
        if kv_cache is not None:  # an fp8 (or narrower) cache: attend to K/V as it holds them
            # cast once, here: the backend stores these and widens what it attends to (rounding to
            # the cache's format and back, then casting again to store, took two casts a layer)
            k, v = to_cache(k, kv_cache[0].dtype), to_cache(v, kv_cache[1].dtype)
        extra = {} if self.softcap is None else {"softcap": self.softcap}
        if sinks is not None:
            extra["sinks"] = sinks
        out = self.backend(q, k, v, meta, kv_cache, self.scale, self.window, **extra)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
