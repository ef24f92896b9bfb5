"""Paged attention as one Triton kernel: the CUDA backend when flash-attn is absent and the
installed torch's ``varlen_attn`` cannot read a block table (torch 2.11 has neither), so that
attention reads each sequence's K/V straight from the paged cache instead of gathering it.

One kernel serves decode rows and prefill chunks alike. A program takes a *tile*: up to
``BLOCK_Q`` consecutive query tokens of one sequence and one KV head, with that head's GQA
group of query heads stacked into the tile's rows (``BLOCK_Q x GROUP`` rows, so a KV block
read once serves the whole group). An fp8 cache's K/V are widened to q's dtype as they load
(exact: e4m3's and e5m2's values are all bfloat16 values); tiles are sized by q's dtype. It streams the sequence's keys/values ``BLOCK_N`` tokens
at a time through the block table with an online softmax (fp32 accumulators). Causal masking
is lower-right aligned: query ``j`` of a chunk of ``q_len`` new tokens sits at position
``seq_len - q_len + j``, which is what a chunk after cached tokens needs. With a sliding
``window`` (> 0) a query also skips keys more than ``window - 1`` positions behind it, and a
tile starts at the first ``BLOCK_N`` run its earliest query still needs. A ``softcap`` (Gemma 2's
``attn_logit_softcapping``; the ``SOFTCAP`` constant, so uncapped launches compile as before)
caps each score to ``softcap * tanh(score / softcap)`` before the mask and the softmax. gpt-oss's
attention sinks (the ``SINKS`` constant; ``sinks``, a logit per query head, joins each row's softmax
as a column whose value row is zero) start a row's online softmax from (max, sum) = (sink, 1).

Launches:
- a decode-only step (including ``static_decode``, what a CUDA graph replays): one tile per
  sequence, the tile index IS the sequence index, nothing read from the host: graph-safe;
- a mixed step: decode rows in one launch (tiles of one query), prefill chunks in another
  (tiles of ``PREFILL_ROWS // GROUP`` queries); the tile -> (sequence, first query) maps are
  built once per step from the host lists and shared by every layer (``meta.backend_plan``);
- no cache (whole prompts, e.g. the warm-up forward): K/V read from the flat ``k``/``v``.

Split-KV decode: when a decode launch has fewer programs (rows x KV heads) than the GPU has
SMs (one stream, a few), each row's keys are cut into ``num_splits`` shares, one program per
share (a third grid axis); each writes its unnormalised output with its (max, sum), and a
second small kernel merges the shares (and adds the sink's column, once per row). A share's
bounds come from the row's context length on the device, so a graph (captured with a fixed
number of shares) stays correct for any context; shares past a short context are empty and
cost one early exit.

Importing this module needs triton; ``backend_select.select_backend`` only picks it when triton
imports. Tests run the kernel on CPU through Triton's interpreter (``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllmini.models.attention import KVCache, write_kv
from vllmini.models.base import AttentionMetadata

# Tile sizes for 16-bit caches; fp32 (exact "ieee" dots) takes half of each, or registers spill.
# bench/triton_compile_check.py compiles every launch for sm_90 (no GPU needed) and reports
# registers, spills and shared memory.
BLOCK_N = 64  # keys per inner-loop iteration
PREFILL_ROWS = 64  # tile rows (queries x group heads) of a prefill launch
MIN_DOT = 16  # tl.dot needs every dimension >= 16
SPLIT_MAX = 16  # split-KV decode: at most this many shares per row (more only adds merging)
SPLIT_MIN_KEYS = 256  # ... and none shorter than this when the step's longest context is known


# Each distinct specialization of an argument is a compile (seconds) in the middle of serving.
# The block-table width changes from step to step (Triton would specialize it on == 1 and on
# divisibility by 16), and a tile map's second row starts at 4 x (number of tiles) bytes (its
# alignment would vary); neither value helps the generated code, so neither is specialized.
@triton.jit
def _tanh(x):
    """tanh from one exp of a non-positive argument (no overflow); ``tl`` has no tanh in every
    Triton this runs on (3.9's has none outside libdevice, which the interpreter lacks)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _finite(x):
    """``x`` within +-1e30: a sink of -inf (no sink) or +inf (all of the softmax) gives no inf - inf."""
    return tl.minimum(tl.maximum(x, -1.0e30), 1.0e30)


@triton.jit(
    do_not_specialize=["stride_bt", "num_tokens", "window", "softcap"],
    do_not_specialize_on_alignment=["tile_seq_ptr", "tile_start_ptr"],
)
def _paged_attention_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr,
    block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr, tile_seq_ptr, tile_start_ptr,
    part_ptr, ml_ptr, sinks_ptr,
    scale, num_tokens, window, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_bt,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TILE_IS_SEQ: tl.constexpr, PAGED: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr,
    SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    if TILE_IS_SEQ:
        seq = tile
        first_q = 0
    else:
        seq = tl.load(tile_seq_ptr + tile)
        first_q = tl.load(tile_start_ptr + tile)
    q_begin = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    cached = seq_len - q_len  # tokens before this chunk (0 without a cache)

    rows = tl.arange(0, BLOCK_M)
    qi = first_q + rows // GROUP  # query index within the chunk
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (qi < q_len)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_rows = (q_begin + qi).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    )  # fmt: skip
    last_pos = cached + qi  # each row attends to keys at positions <= its own (and > last_pos - window)
    kv_end = tl.minimum(seq_len, cached + first_q + BLOCK_Q)
    kv_lo = 0
    if window > 0:  # the tile's earliest query needs nothing before its window
        kv_lo = tl.maximum(cached + first_q - window + 1, 0) // BLOCK_N * BLOCK_N
    if SPLIT:  # split-KV: this program takes share program_id(2) of the keys (BLOCK_N-aligned)
        share = tl.cdiv(tl.cdiv(kv_end - kv_lo, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        kv_begin = kv_lo + tl.program_id(2) * share
        kv_end = tl.minimum(kv_end, kv_begin + share)
    else:
        kv_begin = kv_lo

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a fully masked chunk adds 0, never NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if SINKS and not SPLIT:  # the sink's column (its value row zero) from the start; split: in the merge
        m_i = _finite(tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32))
        l_i += 1.0
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for start in range(kv_begin, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_end
        if PAGED:
            block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=pos_ok, other=0)
            token = block.to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_ks
        else:  # flat k/v [T, Hkv, D]: this sequence's keys are its own query rows
            token = (q_begin + pos).to(tl.int64) * stride_ks
        kv_off = token + kv_head * stride_kh
        kv_mask = pos_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)  # [N, D]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M, N]
        if SOFTCAP:
            s = softcap * _tanh(s / softcap)
        keep = (pos[None, :] <= last_pos[:, None]) & pos_ok[None, :]
        keep = keep & ((window <= 0) | (pos[None, :] > last_pos[:, None] - window))
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)  # [N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if SPLIT:  # unnormalised share of row (token, head): acc [S, T, H, D], (max, sum) [S, T, H, 2]
        part = (tl.program_id(2) * num_tokens + q_rows) * (GROUP * tl.num_programs(1)) + head
        tl.store(part_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])
        tl.store(ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + part * 2 + 1, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :],
        )  # fmt: skip


@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
def _merge_splits_kernel(
    out_ptr, part_ptr, ml_ptr, sinks_ptr, num_tokens, num_splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, SINKS: tl.constexpr = False,
):  # fmt: skip
    """One (token, head) per program: rescale each share's sums to the row's overall max and
    add them up (a share with no keys has max -1e30 and sum 0: weight 0); with ``SINKS`` the
    head's sink logit is one more share of sum 1 and no output."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    ok = splits < num_splits
    part = (splits * num_tokens + token).to(tl.int64) * tl.num_programs(1) + head
    m = tl.load(ml_ptr + part * 2, mask=ok, other=-1.0e30)
    l = tl.load(ml_ptr + part * 2 + 1, mask=ok, other=0.0)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    acc = tl.load(part_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=ok[:, None] & dim_ok[None, :], other=0.0)
    top = tl.max(m, 0)
    if SINKS:
        sink = _finite(tl.load(sinks_ptr + head).to(tl.float32))
        top = tl.maximum(top, sink)
        sink_sum = tl.exp(sink - top)
    else:
        sink_sum = 0.0
    w = tl.exp(m - top)
    total = tl.sum(w * l, 0) + sink_sum
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok
    )


@dataclass
class _Launch:
    """One kernel launch: ``num_tiles`` tiles of ``block_q`` queries; ``tiles`` is ``[2, n]``
    int32 (sequence, first query) or None when tile i is sequence i; ``constants`` are its
    compile-time constants (``kernel_constants``), worked out once per step, not per layer;
    ``num_splits`` > 1: split-KV decode (each row's keys in that many shares, then merged)."""

    block_q: int
    num_tiles: int
    tiles: torch.Tensor | None
    constants: dict
    num_splits: int = 1


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _shrink(dtype: torch.dtype) -> int:
    return 1 if dtype.itemsize <= 2 else 2


def prefill_block_q(dtype: torch.dtype, group: int, head_dim: int = 128) -> int:
    """Queries per prefill tile: the tile's rows hold ``block_q x group`` (query, head) pairs. An
    fp32 tile past head_dim 128 holds half as many (with 32 rows it spilled 0.8-5 KB on sm_90)."""
    rows = PREFILL_ROWS // _shrink(dtype) // (2 if dtype == torch.float32 and head_dim > 128 else 1)
    return max(rows // group, 1)


def kernel_constants(
    dtype: torch.dtype, head_dim: int, group: int, block_q: int, block_size: int, *, tile_is_seq: bool, paged: bool,
    split: bool = False, cache_dtype: torch.dtype | None = None, softcap: bool = False, sinks: bool = False,
) -> dict:  # fmt: skip
    """The compile-time constants of one launch: what the launcher passes, and what
    bench/triton_compile_check.py compiles ahead of time for a GPU this machine may not have.
    An fp32 split-KV launch takes 16 keys a step, not 32: with 32, Triton 3.6 (the GPU image's)
    gives it 255 registers and spills 360 bytes at head_dim 128 (Triton 3.9: 80 registers). A
    split-KV launch over an fp8 cache (``cache_dtype``; None: q's dtype) takes half too: the
    widening's registers spilled 8 bytes at head_dim 128 with 64 keys a step (Triton 3.9).
    ``softcap``: the launch caps its scores (the value is a run-time argument); ``sinks``: its softmax
    has gpt-oss's sink logits (a run-time tensor; a split launch leaves them to the merge). A prefill tile
    (``block_q > 1``) past head_dim 128 (Gemma's 256) takes half the keys a step: with 64, its
    64 x 256 accumulator and queries spilled 40-160 bytes on sm_90 (Triton 3.9); with 32 none,
    and half the shared memory."""
    head_dim_pad = max(_next_pow2(head_dim), MIN_DOT)
    narrow = split and (dtype == torch.float32 or (cache_dtype is not None and cache_dtype.itemsize == 1))
    narrow = narrow or (block_q > 1 and head_dim_pad > 128)
    block_n = BLOCK_N // _shrink(dtype) // (2 if narrow else 1)
    return {
        "BLOCK_SIZE": block_size, "HEAD_DIM": head_dim, "HEAD_DIM_PAD": head_dim_pad,
        "GROUP": group, "BLOCK_Q": block_q, "BLOCK_M": max(_next_pow2(block_q * group), MIN_DOT),
        "BLOCK_N": block_n, "TILE_IS_SEQ": tile_is_seq, "PAGED": paged,
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32", "SPLIT": split, "SOFTCAP": softcap,
        "SINKS": sinks,
    }  # fmt: skip


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (Triton's interpreter), so
    that decode never splits there unless a test asks for it."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(num_programs: int, max_context: int | None, num_sms: int) -> int:
    """Shares per row for a decode launch of ``num_programs`` (rows x KV heads) programs.
    Few rows leave most SMs idle while each program walks a whole context (one stream, long
    context): then each row's keys are split so that there are about two programs per SM.
    ``max_context`` (None for a graph, whose contexts are not known at capture) caps the
    split so that no share is shorter than ``SPLIT_MIN_KEYS``."""
    if num_programs >= num_sms:
        return 1
    splits = min(SPLIT_MAX, -(-2 * num_sms // num_programs))
    if max_context is not None:
        splits = min(splits, -(-max_context // SPLIT_MIN_KEYS))
    return max(splits, 1)


def _plan(
    meta: AttentionMetadata, dtype: torch.dtype, head_dim: int, group: int, num_kv_heads: int, block_size: int,
    paged: bool, cache_dtype: torch.dtype | None = None, softcap: bool = False, sinks: bool = False,
) -> list[_Launch]:  # fmt: skip
    """Split the step into launches (see the module docstring), once per step."""

    def launch(block_q: int, num_tiles: int, tiles: torch.Tensor | None, splits: int = 1) -> _Launch:
        constants = kernel_constants(
            dtype, head_dim, group, block_q, block_size, tile_is_seq=tiles is None, paged=paged, split=splits > 1,
            cache_dtype=cache_dtype, softcap=softcap, sinks=sinks,
        )
        return _Launch(block_q, num_tiles, tiles, constants, splits)

    device = meta.seq_lens.device
    if meta.static_decode or meta.max_seqlen_q == 1:
        max_context = None if meta.static_decode else meta.max_seqlen_k
        splits = decode_splits(meta.num_seqs * num_kv_heads, max_context, _num_sms(device)) if paged else 1
        return [launch(1, meta.num_seqs, None, splits)]
    prefill_q = prefill_block_q(dtype, group, head_dim)
    decode_seqs = [i for i, q in enumerate(meta.query_lens_cpu) if q == 1]
    chunks = [(i, s) for i, q in enumerate(meta.query_lens_cpu) if q > 1 for s in range(0, q, prefill_q)]
    launches = []
    for block_q, seqs, starts in (
        (1, decode_seqs, [0] * len(decode_seqs)),
        (prefill_q, [c[0] for c in chunks], [c[1] for c in chunks]),
    ):
        if seqs:
            tiles = torch.tensor([seqs, starts], dtype=torch.int32).to(device, non_blocking=True)
            launches.append(launch(block_q, len(seqs), tiles))
    return launches


def triton_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    kv_cache: KVCache | None,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [T, H, D]``, ``k/v [T, Hkv, D]`` -> ``[T, H, D]``; writes the new K/V into the cache
    first (one indexed copy each, as every backend does). ``softcap``: scores capped (Gemma 2);
    ``sinks [H]``: gpt-oss's sink logit per query head."""
    num_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    group = num_heads // num_kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if kv_cache is not None:
        write_kv(k, v, kv_cache, meta.slot_mapping)
        keys, vals = kv_cache
        block_tables, block_size = meta.block_tables, keys.shape[1]
    else:
        keys, vals = k.contiguous(), v.contiguous()
        keys, vals = keys.unsqueeze(0), vals.unsqueeze(0)  # a single "block" holding every token
        block_tables, block_size = meta.seq_lens, 1  # unused (PAGED=False); any int tensor will do
    plan = meta.backend_plan
    if plan is None:
        plan = meta.backend_plan = _plan(
            meta, q.dtype, head_dim, group, num_kv_heads, block_size, paged=kv_cache is not None, cache_dtype=keys.dtype,
            softcap=softcap is not None, sinks=sinks is not None,
        )
    for launch in plan:
        run_launch(launch, out, q, keys, vals, block_tables, meta, scale, window, softcap, sinks)
    return out


def run_launch(
    launch: _Launch, out: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
    block_tables: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None,
    softcap: float | None = None, sinks: torch.Tensor | None = None, **overrides: int,
) -> None:  # fmt: skip
    """One kernel launch of a plan. ``overrides`` replace compile-time constants or launch
    options (``BLOCK_N``, ``num_warps``, ``num_stages``): bench/attention_micro.py sweeps them."""
    # without a tile map the kernel never reads these pointers (TILE_IS_SEQ): any int tensor
    tile_seq, tile_start = (meta.seq_lens,) * 2 if launch.tiles is None else launch.tiles.unbind(0)
    splits = launch.num_splits
    if splits > 1:  # each share's unnormalised output and (max, sum), merged below
        part = torch.empty((splits, *q.shape), dtype=torch.float32, device=q.device)
        ml = torch.empty((splits, *q.shape[:2], 2), dtype=torch.float32, device=q.device)
    else:
        part, ml = out, meta.seq_lens  # not read (SPLIT is False)
    constants = {**launch.constants, **overrides}
    if constants["SOFTCAP"] != (softcap is not None):  # (a plan is per step, shared by every layer)
        raise ValueError(f"a launch planned {'with' if constants['SOFTCAP'] else 'without'} a softcap run with {softcap}")
    if constants["SINKS"] != (sinks is not None) or (sinks is not None and sinks.shape != q.shape[1:2]):
        raise ValueError(f"a launch planned {'with' if constants['SINKS'] else 'without'} sinks for {q.shape[1]} heads "
                         f"run with {None if sinks is None else tuple(sinks.shape)}")  # fmt: skip
    sinks_arg = q if sinks is None else sinks.contiguous()  # (not read without SINKS)
    _paged_attention_kernel[(launch.num_tiles, keys.shape[2], splits)](
        out, q, keys, vals,
        block_tables, meta.seq_lens, meta.cu_seqlens_q, tile_seq, tile_start,
        part, ml, sinks_arg,
        scale, q.shape[0], window or 0, softcap or 1.0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), block_tables.stride(0),
        **constants,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(q.shape[0], q.shape[1])](
            out, part, ml, sinks_arg, q.shape[0], splits, out.stride(0), out.stride(1),
            HEAD_DIM=constants["HEAD_DIM"], HEAD_DIM_PAD=constants["HEAD_DIM_PAD"], SPLITS_PAD=_next_pow2(splits),
            SINKS=constants["SINKS"],
        )  # fmt: skip
