"""The Triton paged-attention kernel against the torch backend and a dense reference: every
batch shape the engine produces (decode rows, prefill chunks, chunks after cached tokens,
mixes, whole prompts without a cache), GQA groups of 1/2/3/4 and head dims that are not
powers of two; then whole models and the engine with the kernel in place of the torch
backend. Without CUDA the kernel runs in Triton's interpreter on CPU tensors; with CUDA the
kernel-level tests run it compiled on the GPU (tests/test_cuda.py covers the models there).
The padded static decode (what a graph replays) is a parameter of tests/test_cuda_path.py."""
from __future__ import annotations

import pytest
import torch

from helpers import TRITON_INTERPRETED, greedy_paged, tiny_llama_config, tiny_qwen3_config, triton_skip_reason
from test_attention import BS, D, MIXES, build_batch, dense_reference
from test_cuda_path import _random_model
from vllmini.models.attention import torch_attention
from vllmini.models.base import AttentionMetadata

pytestmark = pytest.mark.skipif(triton_skip_reason() is not None, reason=str(triton_skip_reason()))
DEVICE = torch.device("cpu" if TRITON_INTERPRETED else "cuda")
on_interpreter = pytest.mark.skipif(triton_skip_reason(cpu_tensors=True) is not None,
                                    reason=str(triton_skip_reason(cpu_tensors=True)))  # fmt: skip


@pytest.fixture(scope="module")
def ta():
    """vllmini.models.triton_attention; its kernel runs in the interpreter on CPU tensors
    without CUDA, compiled on CUDA tensors with it."""
    import vllmini.models.triton_attention as module

    return module


def on_device(*tensors):
    return [t.to(DEVICE) if isinstance(t, torch.Tensor) else tuple(x.to(DEVICE) for x in t) for t in tensors]


def _plain_meta(meta: AttentionMetadata, device: torch.device = torch.device("cpu")) -> AttentionMetadata:
    """The same step's metadata, fresh (backend plans are per backend), on ``device``."""
    return AttentionMetadata.paged(
        meta.query_lens_cpu, meta.seq_lens_cpu, meta.slot_mapping.tolist(), meta.block_tables.tolist(), device=device
    )


def run_kernel(ta, q, k, v, meta, cache, scale, window=None, **capped):
    """The kernel on DEVICE; returns its output and the cache it wrote, on the CPU (``capped``: its softcap
    or sinks)."""
    q, k, v = on_device(q, k, v)
    cache = None if cache is None else tuple(on_device(*cache))
    meta = _plain_meta(meta, DEVICE) if cache is not None else AttentionMetadata.for_prompts(meta.query_lens_cpu, DEVICE)
    capped = {name: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for name, x in capped.items()}
    out = ta.triton_attention(q, k, v, meta, cache, scale, window, **capped)
    return out.cpu(), None if cache is None else tuple(c.cpu() for c in cache)


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_kernel_matches_torch_backend_and_dense_reference(ta, mix):
    q_lens, seq_lens = MIXES[mix]
    q, k, v, cache, meta, hk, hv = build_batch(q_lens, seq_lens, seed=5)
    out, written = run_kernel(ta, q, k, v, meta, cache, D**-0.5)
    ref = torch_attention(q, k, v, meta, cache, D**-0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(written[0], cache[0])  # the same K/V written at the same slots
    torch.testing.assert_close(written[1], cache[1])
    start = 0
    for ql, k_seq, v_seq in zip(q_lens, hk, hv):
        dense = dense_reference(q[start : start + ql], k_seq, v_seq, D**-0.5)
        torch.testing.assert_close(out[start : start + ql], dense, atol=1e-5, rtol=1e-5)
        start += ql


def test_plan_splits_mixed_steps_into_decode_and_prefill_launches(ta):
    *_, meta = build_batch([1, 70, 1, 3], [9, 70, 17, 12])[:5]
    assert ta.prefill_block_q(torch.float32, 2) == 16 and ta.prefill_block_q(torch.bfloat16, 3) == 21
    launches = ta._plan(meta, torch.bfloat16, head_dim=D, group=2, num_kv_heads=2, block_size=BS, paged=True)
    assert [(x.block_q, x.num_tiles) for x in launches] == [(1, 2), (32, 4)]  # 70 tokens: 3 tiles of 32
    assert launches[0].tiles.tolist() == [[0, 2], [0, 0]]
    assert launches[1].tiles.tolist() == [[1, 1, 1, 3], [0, 32, 64, 0]]
    assert launches[1].constants == ta.kernel_constants(torch.bfloat16, D, 2, 32, BS, tile_is_seq=False, paged=True)
    *_, decode_meta = build_batch([1, 1], [4, 9])[:5]
    decode = ta._plan(decode_meta, torch.bfloat16, D, 3, 2, BS, True)
    assert [(x.block_q, x.num_tiles, x.tiles, x.num_splits) for x in decode] == [(1, 2, None, 1)]  # short contexts


def test_decode_splits(ta):
    assert ta.decode_splits(num_programs=132, max_context=4096, num_sms=132) == 1  # every SM busy already
    assert ta.decode_splits(8, None, 132) == ta.SPLIT_MAX  # one stream in a graph: context unknown
    assert ta.decode_splits(8, 4096, 132) == ta.SPLIT_MAX and ta.decode_splits(8, 600, 132) == 3  # shares >= 256 keys
    assert ta.decode_splits(8, 100, 132) == 1
    assert ta.decode_splits(128, None, 132) == 3  # ~2 programs per SM
    assert ta.decode_splits(1, None, 1) == 1  # the interpreter: one "SM"


@pytest.mark.parametrize("heads,kv_heads,dtype", [(4, 2, torch.float32), (6, 2, torch.float32), (4, 4, torch.float16)])
def test_split_kv_decode_matches_torch_backend(ta, monkeypatch, heads, kv_heads, dtype):
    """Decode rows whose keys are split into shares and merged: contexts shorter than the
    number of shares (empty shares), one block, many blocks."""
    monkeypatch.setattr(ta, "_num_sms", lambda device: 64)
    monkeypatch.setattr(ta, "SPLIT_MIN_KEYS", 8)
    g = torch.Generator().manual_seed(heads + kv_heads)
    head_dim, block_size, seq_lens = 32, 16, [1, 5, 70, 130, 33]
    tables = [list(range(i * 9, i * 9 + -(-n // block_size))) for i, n in enumerate(seq_lens)]
    cache = tuple(torch.randn(45, block_size, kv_heads, head_dim, generator=g) for _ in range(2))
    slots = [t[(n - 1) // block_size] * block_size + (n - 1) % block_size for t, n in zip(tables, seq_lens)]
    meta = AttentionMetadata.paged([1] * len(seq_lens), seq_lens, slots, tables)
    (launch,) = ta._plan(_plain_meta(meta, DEVICE), dtype, head_dim, heads // kv_heads, kv_heads, block_size, True)
    # 5 rows x kv_heads programs for 64 "SMs": 13 (or 7) shares, most of them empty for short rows
    assert launch.num_splits == {2: 13, 4: 7}[kv_heads] and launch.constants["SPLIT"]
    q = torch.randn(len(seq_lens), heads, head_dim, generator=g)
    k, v = (torch.randn(len(seq_lens), kv_heads, head_dim, generator=g) for _ in range(2))
    cast = [x.to(dtype) for x in (q, k, v)]
    out, _ = run_kernel(ta, *cast, meta, tuple(c.to(dtype) for c in cache), head_dim**-0.5)
    ref = torch_attention(q, k, v, meta, cache, head_dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def _paged_step(g, heads: int, kv_heads: int, head_dim: int, q_lens: list[int], seq_lens: list[int], block_size=16):
    """A step's q/k/v and metadata over a paged cache of random contents (9 blocks per sequence)."""
    tables = [list(range(i * 9, i * 9 + -(-n // block_size))) for i, n in enumerate(seq_lens)]
    cache = tuple(torch.randn(9 * len(seq_lens), block_size, kv_heads, head_dim, generator=g) for _ in range(2))
    slots = [t[p // block_size] * block_size + p % block_size
             for t, s, ql in zip(tables, seq_lens, q_lens) for p in range(s - ql, s)]  # fmt: skip
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g)
    k, v = (torch.randn(sum(q_lens), kv_heads, head_dim, generator=g) for _ in range(2))
    return q, k, v, AttentionMetadata.paged(q_lens, seq_lens, slots, tables), cache


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(4, 4, 16), (8, 4, 64), (6, 2, 24), (16, 4, 8), (2, 1, 128), (4, 1, 256)]
)  # fmt: skip
def test_kernel_shapes_gqa_groups_and_head_dims(ta, heads, kv_heads, head_dim):
    """Long chunks over several KV blocks and tiles (prefill tile = 64 // group queries), a
    chunk after cached tokens, decode rows; fp32 everywhere (the kernel computes in fp32).
    Gemma's head_dim 256: a prefill tile of half the rows and keys (kernel_constants)."""
    g = torch.Generator().manual_seed(heads * 100 + head_dim)
    q, k, v, meta, cache = _paged_step(g, heads, kv_heads, head_dim, [1, 90, 37, 1], [70, 90, 100, 1])
    out, _ = run_kernel(ta, q, k, v, meta, cache, head_dim**-0.5)
    ref = torch_attention(q, k, v, meta, cache, head_dim**-0.5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("window", [1, 5, 40, 300])
def test_sliding_window_on_every_launch_kind(ta, monkeypatch, window, split):
    """Prefill tiles (long chunks over several KV blocks, a chunk after cached tokens), decode
    rows (split into shares or not), prompts without a cache: each query sees only its last
    ``window`` keys, as the torch backend computes it."""
    if split:
        monkeypatch.setattr(ta, "_num_sms", lambda device: 64)
        monkeypatch.setattr(ta, "SPLIT_MIN_KEYS", 8)
    heads, kv_heads, head_dim = 6, 2, 24
    g = torch.Generator().manual_seed(window)
    for q_lens, seq_lens in (([1, 90, 37, 1], [70, 90, 100, 1]), ([1, 1, 1], [130, 45, 7])):
        q, k, v, meta, cache = _paged_step(g, heads, kv_heads, head_dim, q_lens, seq_lens)
        out, _ = run_kernel(ta, q, k, v, meta, cache, head_dim**-0.5, window)
        ref = torch_attention(q, k, v, meta, cache, head_dim**-0.5, window)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    lens = [3, 70, 1]
    q, k, v = (torch.randn(sum(lens), n, head_dim, generator=g) for n in (heads, kv_heads, kv_heads))
    meta = AttentionMetadata.for_prompts(lens)
    out, _ = run_kernel(ta, q, k, v, meta, None, 0.2, window)
    torch.testing.assert_close(out, torch_attention(q, k, v, meta, None, 0.2, window), atol=2e-5, rtol=2e-5)


def score_options(feature: str, dtype: torch.dtype) -> dict:
    """Gemma 2's softcap (0.5 against scores ~N(0, 1): it bites), or gpt-oss's sinks, one per head of 6."""
    return {"softcap": 0.5} if feature == "softcap" else {"sinks": torch.linspace(-1.0, 3.0, 6).to(dtype)}


@pytest.mark.parametrize("feature", ["softcap", "sinks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_caps_scores_and_adds_sinks_on_every_launch_kind(ta, monkeypatch, dtype, feature):
    """Gemma 2's softcap (the SOFTCAP constant) and gpt-oss's attention sinks (SINKS: a row's softmax starts
    from the sink; a split decode's merge adds it, once per row): prefill tiles after cached tokens, decode
    rows in a mixed step, decode rows split into shares, the static decode a graph replays, prompts without a
    cache, with and without a window, as the torch backend computes them; without either the kernel is far
    off. (float16, not bfloat16: the interpreter computes bfloat16 wrongly.)"""
    from vllmini.models.base import block_table_tensor

    monkeypatch.setattr(ta, "_num_sms", lambda device: 16)
    monkeypatch.setattr(ta, "SPLIT_MIN_KEYS", 8)
    heads, kv_heads, head_dim = 6, 2, 24
    tol = 2e-5 if dtype == torch.float32 else 3e-3
    options, wide = score_options(feature, dtype), score_options(feature, torch.float32)
    g = torch.Generator().manual_seed(21)
    for q_lens, seq_lens in (([1, 40, 9, 1], [70, 40, 33, 1]), ([1, 1, 1], [70, 45, 7])):
        q, k, v, meta, cache = _paged_step(g, heads, kv_heads, head_dim, q_lens, seq_lens)
        for window in (None, 5):
            out, _ = run_kernel(ta, *(x.to(dtype) for x in (q, k, v)), meta, tuple(c.to(dtype) for c in cache),
                                head_dim**-0.5, window, **options)  # fmt: skip
            ref = torch_attention(q, k, v, _plain_meta(meta), cache, head_dim**-0.5, window, **wide)
            torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
            assert (torch_attention(q, k, v, _plain_meta(meta), cache, head_dim**-0.5, window) - ref).abs().max() > 0.1
    cu = torch.arange(4, dtype=torch.int32)  # the last step's decode rows again, as a graph replays them (split)
    tables = block_table_tensor(meta.block_tables.tolist(), 6)
    static = AttentionMetadata.for_static_decode(*on_device(cu, cu, meta.seq_lens, meta.slot_mapping, tables), 96)
    assert ta._plan(static, torch.float32, head_dim, 3, kv_heads, 16, True)[0].num_splits > 1
    got = ta.triton_attention(*on_device(q, k, v), static, tuple(on_device(*cache)), head_dim**-0.5,
                              **{name: x.to(DEVICE) if feature == "sinks" else x for name, x in wide.items()})  # fmt: skip
    ref = torch_attention(q, k, v, _plain_meta(meta), cache, head_dim**-0.5, **wide)
    torch.testing.assert_close(got.cpu(), ref, atol=2e-5, rtol=2e-5)
    lens = [3, 20, 1]
    q, k, v = (torch.randn(sum(lens), n, head_dim, generator=g) for n in (heads, kv_heads, kv_heads))
    meta = AttentionMetadata.for_prompts(lens)
    out, _ = run_kernel(ta, q, k, v, meta, None, 0.3, 5, **wide)
    torch.testing.assert_close(out, torch_attention(q, k, v, meta, None, 0.3, 5, **wide), atol=2e-5, rtol=2e-5)


def test_infinite_sinks(ta):
    """Also where a row's first keys are all masked (a window behind a prefill tile's first query): the
    sink is clamped to +-1e30, so no exp(-inf + inf); +inf takes the whole softmax; and a plan without
    sinks refuses them."""
    g = torch.Generator().manual_seed(23)
    q, k, v, meta, cache = _paged_step(g, 6, 2, 24, [1, 40, 1], [70, 40, 33])
    out, _ = run_kernel(ta, q, k, v, meta, cache, 24**-0.5, 3, sinks=torch.full((6,), float("-inf")))
    torch.testing.assert_close(out, torch_attention(q, k, v, _plain_meta(meta), cache, 24**-0.5, 3), atol=2e-5,
                               rtol=2e-5)  # fmt: skip
    out, _ = run_kernel(ta, q, k, v, meta, cache, 24**-0.5, 3, sinks=torch.full((6,), float("inf")))
    assert out.abs().max() == 0  # (+inf: the sink takes the whole softmax)
    plan = ta._plan(_plain_meta(meta, DEVICE), torch.float32, 24, 3, 2, 16, True)
    with pytest.raises(ValueError, match="a launch planned without sinks for 6 heads run with"):
        ta.run_launch(plan[0], *on_device(q, q, *cache, meta.block_tables), meta, 0.3, sinks=torch.zeros(6))


def test_kernel_without_cache_and_in_fp16(ta):
    lens = [3, 70, 1, 12]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(sum(lens), n, 32, generator=g) for n in (8, 2, 2))
    meta = AttentionMetadata.for_prompts(lens)
    out, _ = run_kernel(ta, q, k, v, meta, None, 0.2)
    ref = torch_attention(q, k, v, meta, None, 0.2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    half, _ = run_kernel(ta, q.half(), k.half(), v.half(), meta, None, 0.2)
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.float(), ref, atol=2e-3, rtol=2e-3)


def test_kernel_reads_a_noncontiguous_query(ta):
    """The model hands attention q as a view of the fused qkv projection."""
    q_lens, seq_lens = MIXES["mixed"]
    q, k, v, cache, meta, *_ = build_batch(q_lens, seq_lens, seed=7)
    wide = torch.cat([q, torch.full_like(q, float("nan"))], dim=1)[:, : q.shape[1]]
    assert not wide.is_contiguous()
    wide, k, v = on_device(wide, k, v)
    out = ta.triton_attention(wide, k, v, _plain_meta(meta, DEVICE), tuple(on_device(*cache)), D**-0.5).cpu()
    torch.testing.assert_close(out, torch_attention(q, k.cpu(), v.cpu(), meta, cache, D**-0.5), atol=1e-5, rtol=1e-5)


@on_interpreter
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_model_greedy_tokens_equal_torch_backend(ta, arch):
    config = (tiny_llama_config if arch == "llama" else tiny_qwen3_config)()
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 33, 1)]
    expected = greedy_paged(_random_model(config, torch_attention), prompts, max_new=6, block_size=8)
    assert greedy_paged(_random_model(config, ta.triton_attention), prompts, max_new=6, block_size=8) == expected


@on_interpreter
@pytest.mark.parametrize("split", [False, True])
def test_engine_with_the_kernel_equals_torch_backend(ta, tmp_path, monkeypatch, split):
    """The whole engine (chunked prefill, prefix-cache hits, mixed steps, decode steps through
    the static graph path) with the kernel swapped in: the same greedy tokens. ``split``: every
    decode launch splits its rows' keys (as on a GPU with idle SMs)."""
    if split:
        monkeypatch.setattr(ta, "_num_sms", lambda device: 32)  # > rows x KV heads: every decode splits
        monkeypatch.setattr(ta, "SPLIT_MIN_KEYS", 4)
    from bench.random_model import save_random_model, tiny_qwen3_bench_config
    from test_cuda_path import route_decodes_through_graph_runner
    from vllmini import LLM, SamplingParams

    model_dir = save_random_model(tiny_qwen3_bench_config(initializer_range=0.3), tmp_path / "m", torch.float32)
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 512, (20,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 512, (n,), generator=g).tolist() for n in (3, 30, 1)] + [[5]]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (6, 4, 8, 5)]
    kw = dict(model=str(model_dir), max_num_seqs=4, max_num_batched_tokens=24, max_model_len=64,
              kv_cache_memory=2**20, enable_prefix_caching=True)  # fmt: skip

    def generate(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    expected = generate(LLM(**kw))
    llm = LLM(**kw)
    llm.llm_engine.model.set_attention_backend(ta.triton_attention)
    calls = route_decodes_through_graph_runner(llm, max_num_seqs=4, max_model_len=64)
    assert generate(llm) == expected
    stats = llm.llm_engine.scheduler.stats
    assert stats.num_chunked_prefills and stats.num_cached_prompt_tokens and max(calls) > 1  # every path ran


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_kernel_reads_an_fp8_cache_as_the_torch_backend(ta, monkeypatch, model_dtype, cache_dtype):
    """kv_cache_dtype fp8: K/V load as bytes and widen to q's dtype in the kernel (decode rows,
    split decode, prefill chunks after cached tokens); the torch backend gathers and casts.
    (float16, not bfloat16: Triton's interpreter computes bfloat16 wrongly, fp8 or not.)"""
    from vllmini.kv.cache_dtype import round_to_cache, to_cache

    monkeypatch.setattr(ta, "_num_sms", lambda device: 16)  # (the decode rows split their keys)
    monkeypatch.setattr(ta, "SPLIT_MIN_KEYS", 8)
    g = torch.Generator().manual_seed(8)
    q, k, v, meta, cache = _paged_step(g, 8, 2, 32, [1, 40, 1, 1], [70, 90, 33, 1])
    q, k, v = (x.to(model_dtype) for x in (q, k, v))
    k, v = round_to_cache(k, cache_dtype), round_to_cache(v, cache_dtype)
    cache = tuple(to_cache(c, cache_dtype) for c in cache)
    out, written = run_kernel(ta, q, k, v, meta, tuple(c.clone() for c in cache), 32**-0.5)
    ref_cache = tuple(c.clone() for c in cache)
    ref = torch_attention(q, k, v, meta, ref_cache, 32**-0.5)
    tol = 1e-5 if model_dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(written, ref_cache))
    decode_meta = build_batch([1, 1], [40, 9])[4]
    (launch,) = ta._plan(decode_meta, model_dtype, 32, 4, 2, BS, True)
    assert launch.constants == ta.kernel_constants(model_dtype, 32, 4, 1, BS, tile_is_seq=True, paged=True,
                                                   split=launch.num_splits > 1)  # sized by q's dtype, not the cache's
