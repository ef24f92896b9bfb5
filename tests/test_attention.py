"""Attention backends: the torch paged path against a dense reference, the flash-attn glue
against a stand-in with flash-attn's documented semantics, and backend selection."""
from __future__ import annotations

import logging
import math
import sys
import types

import pytest
import torch

from vllmini.models.attention import flash_attention, torch_attention
from vllmini.models.backend_select import FLASH_BLOCK_MULTIPLE, select_backend
from vllmini.models.base import AttentionMetadata, block_table_tensor

H, HKV, D, BS = 6, 2, 8, 4


def dense_reference(
    q_seq: torch.Tensor, k_seq: torch.Tensor, v_seq: torch.Tensor, scale: float, window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Lower-right causal attention of ``q_seq [q, H, D]`` over ``k/v_seq [L, Hkv, D]``; with a
    ``window``, each query sees its last ``window`` positions (transformers' sliding window); with a
    ``softcap``, scores become ``softcap * tanh(scores / softcap)`` (Gemma 2)."""
    q_len, seq_len = q_seq.shape[0], k_seq.shape[0]
    k = k_seq.repeat_interleave(H // HKV, dim=1)
    v = v_seq.repeat_interleave(H // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q_seq, k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    pos_q, pos_k = torch.arange(seq_len - q_len, seq_len)[:, None], torch.arange(seq_len)[None, :]
    allowed = (pos_k <= pos_q) & (pos_k > pos_q - (window or seq_len))
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def build_batch(q_lens: list[int], seq_lens: list[int], seed: int = 0):
    """A mixed batch over a shuffled paged cache: full K/V histories plus metadata."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = [math.ceil(s / BS) for s in seq_lens]
    perm = torch.randperm(sum(n_blocks) + 3, generator=g).tolist()
    tables, start = [], 0
    for n in n_blocks:
        tables.append(perm[start : start + n])
        start += n
    k_cache = torch.randn(len(perm), BS, HKV, D, generator=g)
    v_cache = torch.randn(len(perm), BS, HKV, D, generator=g)
    hist_k = [torch.randn(s, HKV, D, generator=g) for s in seq_lens]
    hist_v = [torch.randn(s, HKV, D, generator=g) for s in seq_lens]
    # earlier tokens are already in the cache; the new ones come in the flat batch
    slots = []
    for t, s, q in zip(tables, seq_lens, q_lens):
        for pos in range(s):
            slot = t[pos // BS] * BS + pos % BS
            if pos >= s - q:
                slots.append(slot)
    for t, s, q, hk, hv in zip(tables, seq_lens, q_lens, hist_k, hist_v):
        for pos in range(s - q):
            k_cache[t[pos // BS], pos % BS] = hk[pos]
            v_cache[t[pos // BS], pos % BS] = hv[pos]
    q = torch.randn(sum(q_lens), H, D, generator=g)
    k = torch.cat([hk[s - ql :] for hk, s, ql in zip(hist_k, seq_lens, q_lens)])
    v = torch.cat([hv[s - ql :] for hv, s, ql in zip(hist_v, seq_lens, q_lens)])
    meta = AttentionMetadata.paged(q_lens, seq_lens, slots, tables)
    return q, k, v, (k_cache, v_cache), meta, hist_k, hist_v


MIXES = {
    "decodes": ([1, 1, 1], [5, 1, 13]),
    "prefills": ([7, 3, 9], [7, 3, 9]),
    "chunk-after-cache": ([4, 6], [11, 6]),
    "mixed": ([1, 5, 1, 8, 2], [9, 5, 17, 12, 2]),
}


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_torch_paged_attention_matches_dense_reference(mix):
    q_lens, seq_lens = MIXES[mix]
    q, k, v, cache, meta, hk, hv = build_batch(q_lens, seq_lens)
    out = torch_attention(q, k, v, meta, cache, D**-0.5)
    start = 0
    for ql, s, k_seq, v_seq in zip(q_lens, seq_lens, hk, hv):
        ref = dense_reference(q[start : start + ql], k_seq, v_seq, D**-0.5)
        torch.testing.assert_close(out[start : start + ql], ref, atol=1e-5, rtol=1e-5)
        start += ql


@pytest.mark.parametrize("mix", ["prefills", "chunk-after-cache"])
def test_prefill_takes_sdpas_fused_cpu_kernel(mix):
    """Prompt chunks reach torch's fused (flash) CPU kernel, never SDPA's math path: the math path
    builds every query x key score and made a 2048-token prompt's attention 7x slower."""
    q_lens, seq_lens = MIXES[mix]
    q, k, v, cache, meta, _, _ = build_batch(q_lens, seq_lens)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch_attention(q, k, v, meta, cache, D**-0.5)
    ops = {event.key for event in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
    assert "aten::_scaled_dot_product_attention_math" not in ops


@pytest.mark.parametrize("window", [1, 3, 6])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_sliding_window_matches_dense_reference(mix, window):
    """Grouped decode (gather + SDPA), chunks after cached tokens and whole prompts, each
    query attending to its last ``window`` positions; and the static (CUDA-graph) decode path."""
    q_lens, seq_lens = MIXES[mix]
    q, k, v, cache, meta, hk, hv = build_batch(q_lens, seq_lens)
    out = torch_attention(q, k, v, meta, cache, D**-0.5, window)
    start = 0
    for ql, k_seq, v_seq in zip(q_lens, hk, hv):
        ref = dense_reference(q[start : start + ql], k_seq, v_seq, D**-0.5, window)
        torch.testing.assert_close(out[start : start + ql], ref, atol=1e-5, rtol=1e-5)
        start += ql
    if max(q_lens) == 1:  # the same rows through the static path, over table columns padded to 8
        tables = block_table_tensor(meta.block_tables.tolist(), 8)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        cu = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
        static = AttentionMetadata.for_static_decode(cu, cu, lens, meta.slot_mapping, tables, 8 * BS)
        torch.testing.assert_close(torch_attention(q, k, v, static, cache, D**-0.5, window), out, atol=1e-5, rtol=1e-5)


def _fake_flash_module(softcap: bool = True) -> types.ModuleType:
    """flash_attn_varlen_func with flash-attn's semantics (paged via block_table, causal aligned
    to the bottom-right, ``softcap`` 0.0 for none), written densely, so our glue can be checked
    without a GPU. ``softcap=False``: flash-attn < 2.6's signature, without the argument."""

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, block_table=None):  # fmt: skip
        assert causal and q.dtype == k.dtype and window_size[1] in (-1, 0)
        window = None if window_size[0] < 0 else window_size[0] + 1  # keys [i - left, i]
        out = torch.empty_like(q)
        for i in range(len(cu_seqlens_q) - 1):
            qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
            seq_len = int(cu_seqlens_k[i + 1] - cu_seqlens_k[i])
            assert qe - qs <= max_seqlen_q and seq_len <= max_seqlen_k
            if block_table is None:
                ks, vs = k[int(cu_seqlens_k[i]) : int(cu_seqlens_k[i + 1])], v[int(cu_seqlens_k[i]) : int(cu_seqlens_k[i + 1])]
            else:
                blocks = block_table[i, : math.ceil(seq_len / k.shape[1])].long()
                ks, vs = k[blocks].flatten(0, 1)[:seq_len], v[blocks].flatten(0, 1)[:seq_len]
            out[qs:qe] = dense_reference(q[qs:qe], ks, vs, softmax_scale, window, softcap or None)
        return out

    def without_softcap(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        softmax_scale=None, causal=False, window_size=(-1, -1), block_table=None):  # fmt: skip
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                      causal, window_size, block_table=block_table)  # fmt: skip

    mod = types.ModuleType("flash_attn")
    mod.flash_attn_varlen_func = flash_attn_varlen_func if softcap else without_softcap
    return mod


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (3, None), (None, 0.5), (3, 0.5)])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_flash_glue_passes_paged_metadata(monkeypatch, mix, window, softcap):
    """The paged metadata, the window and Gemma 2's softcap (flash-attn >= 2.6's argument)."""
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_module())
    q_lens, seq_lens = MIXES[mix]
    q, k, v, cache, meta, _, _ = build_batch(q_lens, seq_lens, seed=1)
    cache_copy = (cache[0].clone(), cache[1].clone())
    capped = {} if softcap is None else {"softcap": softcap}
    out = flash_attention(q, k, v, meta, cache, D**-0.5, window, **capped)
    ref = torch_attention(q, k, v, meta, cache_copy, D**-0.5, window, **capped)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if softcap is not None:  # (the cap bites on these scores)
        assert (torch_attention(q, k, v, meta, cache_copy, D**-0.5, window) - ref).abs().max() > 0.1
    torch.testing.assert_close(cache[0], cache_copy[0])  # both wrote the same new K/V


def test_flash_glue_without_cache(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_module())
    lens = [3, 7, 1]
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(sum(lens), n, D, generator=g) for n in (H, HKV, HKV))
    meta = AttentionMetadata.for_prompts(lens)
    for window in (None, 2):
        torch.testing.assert_close(flash_attention(q, k, v, meta, None, 0.3, window),
                                   torch_attention(q, k, v, meta, None, 0.3, window))  # fmt: skip


def test_backend_selection():
    cpu = torch.device("cpu")
    assert select_backend(None, cpu, torch.float32, 16) == "cpu"  # the C decode kernel (models/cpu_attention.py)
    assert select_backend(None, cpu, torch.bfloat16, 16) == "cpu"  # a bfloat16 cache, float32 math
    assert select_backend(None, cpu, torch.float16, 16) == "torch"  # the kernel reads no float16
    assert select_backend("torch", cpu, torch.float32, 16) == "torch"
    with pytest.raises(ValueError, match="attention_backend='cpu' cannot be used: .*float32 or bfloat16 only"):
        select_backend("cpu", cpu, torch.float16, 16)
    with pytest.raises(ValueError, match="attention_backend='cpu' cannot be used: it runs on the CPU"):
        select_backend("cpu", torch.device("cuda"), torch.float32, 16)
    with pytest.raises(ValueError, match="attention_backend='nope'"):
        select_backend("nope", cpu, torch.float32, 16)
    with pytest.raises(ValueError, match=f"flash_attn.*multiple of {FLASH_BLOCK_MULTIPLE}.*float16/bfloat16"):
        select_backend("flash_attn", cpu, torch.float32, 16)


def set_triton(monkeypatch, present: bool) -> None:
    """Make ``import triton.language`` succeed (a stand-in) or fail, whatever is installed."""
    if present:
        monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
        monkeypatch.setitem(sys.modules, "triton.language", types.ModuleType("triton.language"))
    else:
        monkeypatch.setitem(sys.modules, "triton", None)  # import raises ImportError


def test_cuda_selection_falls_back_when_flash_attn_is_missing(monkeypatch, caplog):
    cuda = torch.device("cuda")  # selection only inspects the device; nothing runs on it
    monkeypatch.setattr(logging.getLogger("vllmini"), "propagate", True)  # let caplog see our records
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import raises ImportError
    set_triton(monkeypatch, present=False)
    with caplog.at_level("WARNING", logger="vllmini"):
        assert select_backend(None, cuda, torch.bfloat16, 256) in ("torch_varlen", "torch")  # per torch's schema
    assert "flash-attn is not importable" in caplog.text
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_module())
    assert select_backend(None, cuda, torch.bfloat16, 256) == "flash_attn"
    assert select_backend(None, cuda, torch.bfloat16, 16) == "torch"  # auto: incompatible block size
    with pytest.raises(ValueError, match="block_size to be a multiple of 256 \\(got 16\\)"):
        select_backend("flash_attn", cuda, torch.bfloat16, 16)
    with pytest.raises(ValueError, match="float16/bfloat16 only"):
        select_backend("flash_attn", cuda, torch.float32, 256)
    set_triton(monkeypatch, present=True)  # what FlashAttention cannot run goes to the Triton kernel
    assert select_backend(None, cuda, torch.bfloat16, 16) == "triton"
    assert select_backend(None, cuda, torch.float32, 256) == "triton"
    assert select_backend(None, cuda, torch.bfloat16, 256) == "flash_attn"  # FlashAttention first


def test_decode_groups_split_only_when_padding_costs_more_than_a_group():
    from vllmini.models.attention import _decode_groups

    assert _decode_groups([]) == []
    assert _decode_groups([3, 9, 5, 7, 4], group_cost=16) == [[0, 4, 2, 3, 1]]  # short, similar: one group
    groups = _decode_groups([2, 48, 3, 50, 1, 47], group_cost=16)  # two clusters far apart
    assert groups == [[4, 0, 2], [5, 1, 3]]
    every = _decode_groups([1, 2, 3, 4], group_cost=0)  # free groups: no padding at all
    assert sorted(map(sorted, every)) == [[0], [1], [2], [3]]
    # the DP over distinct lengths is as cheap as the best split over rows (row-level DP)
    def cost(groups, lens, c):
        return sum(len(g) * max(lens[i] for i in g) + c for g in groups)

    def best_over_rows(lens, c):
        srt = sorted(lens)
        best = [0] + [math.inf] * len(srt)
        for j in range(1, len(srt) + 1):
            best[j] = min(best[i] + (j - i) * srt[j - 1] + c for i in range(j))
        return best[-1]

    g = torch.Generator().manual_seed(0)
    for c in (0, 3, 16):
        for _ in range(20):
            lens = torch.randint(1, 40, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
            assert cost(_decode_groups(lens, group_cost=c), lens, c) == best_over_rows(lens, c)
    # every row lands in exactly one group, for any cost
    lens = [(i * 37) % 61 + 1 for i in range(64)]
    for cost in (0, 4, 16, 1000):
        flat = sorted(i for g in _decode_groups(lens, group_cost=cost) for i in g)
        assert flat == list(range(64))


def test_block_table_tensor_pads_rows_like_the_nested_lists_it_replaces():
    tables = [[5, 1, 9], [2], [], [7, 3]]
    width, rows, pad_block = 5, 6, 11
    nested = [t + [0] * (width - len(t)) for t in tables] + [[pad_block] + [0] * (width - 1)] * (rows - len(tables))
    got = block_table_tensor(tables, width, rows, pad_block)
    assert got.dtype == torch.int32 and got.tolist() == nested
    assert block_table_tensor(tables, 3).tolist() == [t + [0] * (3 - len(t)) for t in tables]
    assert block_table_tensor([], 2, 2, 4).tolist() == [[4, 0], [4, 0]]  # padding only (graph capture)


@pytest.mark.parametrize("window", [None, 3])
def test_torch_decode_zeroes_only_the_hidden_gathered_rows(window):
    """Decode rows over gathered blocks: NaN in every cache slot no row may read (a reused block's
    tail, a padded table column, behind a window) never reaches an output, and the zeroing is one
    ``index_fill_`` per tensor over the hidden rows, not a broadcast ``masked_fill_`` over the
    whole gather (on the CPU that took as long as the gather itself)."""
    q_lens, seq_lens = MIXES["decodes"]
    q, k, v, (k_cache, v_cache), meta, hk, hv = build_batch(q_lens, seq_lens)
    readable = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for b, n in enumerate(seq_lens):
        for p in range(max(0, n - (window or n)), n):
            readable[meta.block_tables[b, p // BS], p % BS] = True
    k_cache[~readable], v_cache[~readable] = float("nan"), float("nan")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = torch_attention(q, k, v, meta, (k_cache, v_cache), D**-0.5, window)
    for b, (k_seq, v_seq) in enumerate(zip(hk, hv)):
        ref = dense_reference(q[b : b + 1], k_seq, v_seq, D**-0.5, window)
        torch.testing.assert_close(out[b : b + 1], ref, atol=1e-5, rtol=1e-5)
    ops = {event.key for event in prof.key_averages()}
    assert "aten::index_fill_" in ops and "aten::masked_fill_" not in ops


@pytest.mark.parametrize(("q_len", "length", "k_first", "window"), [(12, 40, 0, None), (30, 30, 0, None), (12, 37, 8, 7)])
def test_capped_prefill_tiles_bound_the_scores_and_keep_the_output(monkeypatch, q_len, length, k_first, window):
    """Gemma 2's eager prefill (SDPA has no softcap) in tiles of query rows: a chunk after cached tokens, a
    whole prompt, a window behind block-aligned keys. Each tile holds at most SOFTCAP_TILE_SCORES scores and
    no more than the chunk as a whole prompt would (q_len x q_len per head, what the warm-up runs), reads
    only the keys its rows see, and the output is the one-piece call's (to float32 rounding: shorter sums)."""
    from vllmini.models import eager_attention

    g = torch.Generator().manual_seed(q_len)
    q = torch.randn(1, H, q_len, D, generator=g)
    k, v = (torch.randn(1, HKV, length, D, generator=g) for _ in range(2))
    q_first = k_first + length - q_len
    pos_q, pos_k = torch.arange(q_first, q_first + q_len)[:, None], torch.arange(k_first, k_first + length)[None, :]
    mask = (pos_k <= pos_q) & (pos_k > pos_q - (window or length))
    whole = eager_attention.attend(q, k, v, 0.3, 0.5, attn_mask=mask, enable_gqa=True)
    assert (eager_attention.attend(q, k, v, 0.3, attn_mask=mask, enable_gqa=True) - whole).abs().max() > 0.1
    scores, real = [], eager_attention.attend

    def counted(q, k, *args, **kwargs):  # each tile's scores: heads x rows x keys
        scores.append(q.shape[1] * q.shape[2] * k.shape[2])
        return real(q, k, *args, **kwargs)

    monkeypatch.setattr(eager_attention, "attend", counted)
    for budget in (2**22, H * length * 3, 1):
        monkeypatch.setattr(eager_attention, "SOFTCAP_TILE_SCORES", budget)
        scores.clear()
        tiled = eager_attention.capped_prefill(q, k, v, 0.3, 0.5, q_first, k_first, window)
        torch.testing.assert_close(tiled, whole, atol=1e-6, rtol=1e-6)
        assert max(scores) <= max(min(budget, H * q_len * q_len), H * length)  # (one row at least)
        assert sum(scores) <= H * q_len * length
    assert len(scores) == q_len  # the smallest budget: one row a tile
