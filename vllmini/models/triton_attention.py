"""Paged attention as one Triton kernel: the CUDA backend when flash-attn is absent and the
installed torch's ``varlen_attn`` cannot read a block table (torch 2.11 has neither), so that
attention reads each sequence's K/V straight from the paged cache instead of gathering it.

One kernel serves decode rows and prefill chunks alike. A program takes a *tile*: up to
``BLOCK_Q`` consecutive query tokens of one sequence and one KV head, with that head's GQA
group of query heads stacked into the tile's rows (``BLOCK_Q x GROUP`` rows, so a KV block
read once serves the whole group). It streams the sequence's keys/values ``BLOCK_N`` tokens
at a time through the block table with an online softmax (fp32 accumulators). Causal masking
is lower-right aligned: query ``j`` of a chunk of ``q_len`` new tokens sits at position
``seq_len - q_len + j``, which is what a chunk after cached tokens needs.

Launches:
- a decode-only step (including ``static_decode``, what a CUDA graph replays): one tile per
  sequence, the tile index IS the sequence index, nothing read from the host: graph-safe;
- a mixed step: decode rows in one launch (tiles of one query), prefill chunks in another
  (tiles of ``PREFILL_ROWS // GROUP`` queries); the tile -> (sequence, first query) maps are
  built once per step from the host lists and shared by every layer (``meta.backend_plan``);
- no cache (whole prompts, e.g. the warm-up forward): K/V read from the flat ``k``/``v``.

Importing this module needs triton; ``attention.select_backend`` only picks it when triton
imports. Tests run the kernel on CPU through Triton's interpreter (``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

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


# Each distinct specialization of an argument is a compile (seconds) in the middle of serving.
# The block-table width changes from step to step (Triton would specialize it on == 1 and on
# divisibility by 16), and a tile map's second row starts at 4 x (number of tiles) bytes (its
# alignment would vary); neither value helps the generated code, so neither is specialized.
@triton.jit(do_not_specialize=["stride_bt"], do_not_specialize_on_alignment=["tile_seq_ptr", "tile_start_ptr"])
def _paged_attention_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr,
    block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr, tile_seq_ptr, tile_start_ptr,
    scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_bt,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TILE_IS_SEQ: tl.constexpr, PAGED: tl.constexpr, PRECISION: tl.constexpr,
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
    last_pos = cached + qi  # each row attends to keys at positions <= its own
    kv_end = tl.minimum(seq_len, cached + first_q + BLOCK_Q)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a fully masked chunk adds 0, never NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for start in range(0, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_end
        if PAGED:
            block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=pos_ok, other=0)
            token = block.to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_ks
        else:  # flat k/v [T, Hkv, D]: this sequence's keys are its own query rows
            token = (q_begin + pos).to(tl.int64) * stride_ks
        kv_off = token + kv_head * stride_kh
        kv_mask = pos_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [N, D]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M, N]
        s = tl.where((pos[None, :] <= last_pos[:, None]) & pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :],
    )  # fmt: skip


@dataclass
class _Launch:
    """One kernel launch: ``num_tiles`` tiles of ``block_q`` queries; ``tiles`` is ``[2, n]``
    int32 (sequence, first query) or None when tile i is sequence i; ``constants`` are its
    compile-time constants (``kernel_constants``), worked out once per step, not per layer."""

    block_q: int
    num_tiles: int
    tiles: torch.Tensor | None
    constants: dict


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _shrink(dtype: torch.dtype) -> int:
    return 1 if dtype.itemsize <= 2 else 2


def prefill_block_q(dtype: torch.dtype, group: int) -> int:
    """Queries per prefill tile: the tile's rows hold ``block_q x group`` (query, head) pairs."""
    return max(PREFILL_ROWS // _shrink(dtype) // group, 1)


def kernel_constants(
    dtype: torch.dtype, head_dim: int, group: int, block_q: int, block_size: int, *, tile_is_seq: bool, paged: bool
) -> dict:
    """The compile-time constants of one launch: what the launcher passes, and what
    bench/triton_compile_check.py compiles ahead of time for a GPU this machine may not have."""
    return {
        "BLOCK_SIZE": block_size, "HEAD_DIM": head_dim, "HEAD_DIM_PAD": max(_next_pow2(head_dim), MIN_DOT),
        "GROUP": group, "BLOCK_Q": block_q, "BLOCK_M": max(_next_pow2(block_q * group), MIN_DOT),
        "BLOCK_N": BLOCK_N // _shrink(dtype), "TILE_IS_SEQ": tile_is_seq, "PAGED": paged,
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
    }  # fmt: skip


def _plan(
    meta: AttentionMetadata, dtype: torch.dtype, head_dim: int, group: int, block_size: int, paged: bool
) -> list[_Launch]:
    """Split the step into launches (see the module docstring), once per step."""

    def launch(block_q: int, num_tiles: int, tiles: torch.Tensor | None) -> _Launch:
        constants = kernel_constants(dtype, head_dim, group, block_q, block_size, tile_is_seq=tiles is None, paged=paged)
        return _Launch(block_q, num_tiles, tiles, constants)

    if meta.static_decode or meta.max_seqlen_q == 1:
        return [launch(1, meta.num_seqs, None)]
    prefill_q = prefill_block_q(dtype, group)
    decode_seqs = [i for i, q in enumerate(meta.query_lens_cpu) if q == 1]
    chunks = [(i, s) for i, q in enumerate(meta.query_lens_cpu) if q > 1 for s in range(0, q, prefill_q)]
    device = meta.seq_lens.device
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
) -> torch.Tensor:
    """``q [T, H, D]``, ``k/v [T, Hkv, D]`` -> ``[T, H, D]``; writes the new K/V into the cache
    first (one indexed copy each, as every backend does)."""
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
        plan = meta.backend_plan = _plan(meta, keys.dtype, head_dim, group, block_size, paged=kv_cache is not None)
    for launch in plan:
        run_launch(launch, out, q, keys, vals, block_tables, meta, scale)
    return out


def run_launch(
    launch: _Launch, out: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
    block_tables: torch.Tensor, meta: AttentionMetadata, scale: float, **overrides: int,
) -> None:  # fmt: skip
    """One kernel launch of a plan. ``overrides`` replace compile-time constants or launch
    options (``BLOCK_N``, ``num_warps``, ``num_stages``): bench/attention_micro.py sweeps them."""
    # without a tile map the kernel never reads these pointers (TILE_IS_SEQ): any int tensor
    tile_seq, tile_start = (meta.seq_lens,) * 2 if launch.tiles is None else launch.tiles.unbind(0)
    _paged_attention_kernel[(launch.num_tiles, keys.shape[2])](
        out, q, keys, vals,
        block_tables, meta.seq_lens, meta.cu_seqlens_q, tile_seq, tile_start,
        scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), block_tables.stride(0),
        **{**launch.constants, **overrides},
    )  # fmt: skip
