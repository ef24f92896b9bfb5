"""The cpu backend's C decode kernel (vllmini/kernels/paged_decode.c via models/cpu_attention.py):
equal to a plain per-row SDPA over the same paged cache, inputs it cannot take refused by name,
and a build that fails leaves the engine on the torch backend."""
from __future__ import annotations

import logging
import stat

import pytest
import torch
import torch.nn.functional as F

from helpers import tiny_llama_config
from vllmini.models import cpu_attention
from vllmini.models.attention import torch_attention
from vllmini.models.backend_check import check_backend, start_backend
from vllmini.models.base import AttentionMetadata, block_table_tensor
from vllmini.models.cpu_attention import CACHE_DTYPES, KernelBuildError, cpu_attention as cpu_backend, paged_decode

CPU = torch.device("cpu")


def reference(q, k_cache, v_cache, tables, lens, scale, window=None):
    """One SDPA per row over its first ``len`` cached positions, or its last ``window`` of them
    (query head h * G + g reads KV head h, which is SDPA's GQA mapping)."""
    outs = []
    for b, n in enumerate(lens.tolist()):
        lo = max(0, n - window) if window else 0
        keys = k_cache[tables[b].long()].flatten(0, 1)[lo:n].transpose(0, 1)  # [Hkv, n - lo, D]
        vals = v_cache[tables[b].long()].flatten(0, 1)[lo:n].transpose(0, 1)
        qb = q[b].flatten(0, 1)[:, None]  # [H, 1, D]
        outs.append(F.scaled_dot_product_attention(qb, keys, vals, scale=scale, enable_gqa=True).view(q.shape[1:]))
    return torch.stack(outs)


def random_paged(batch, num_kv_heads, group, head_dim, block_size, lens, spare_columns=2, seed=0):
    """Scattered block tables (wider than needed) over a cache with stale garbage in it."""
    g = torch.Generator().manual_seed(seed)
    widths = [-(-n // block_size) for n in lens]
    num_blocks = sum(widths) + 5
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(batch, max(widths) + spare_columns, dtype=torch.int32)
    for b, w in enumerate(widths):
        tables[b, :w] = torch.tensor(perm[:w], dtype=torch.int32)
        perm = perm[w:]
    q = torch.randn(batch, num_kv_heads, group, head_dim, generator=g)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize(
    "num_kv_heads,group,head_dim,block_size,lens",
    [
        (3, 3, 64, 16, [1, 16, 17, 300, 33]),  # SmolLM2's shapes; one token, a block edge, long
        (2, 1, 8, 4, [5, 1, 9]),  # no GQA, tiny head_dim
        (1, 8, 128, 32, [64, 31]),  # one KV head, Qwen-sized head_dim
        (4, 2, 16, 1, [3, 1, 7, 2]),  # block size 1: every token its own block
        (2, 3, 24, 256, [600, 256]),  # CUDA's block size, head_dim not a multiple of 16
    ],
)
def test_kernel_equals_per_row_sdpa(num_kv_heads, group, head_dim, block_size, lens):
    q, k_cache, v_cache, tables, seq_lens = random_paged(len(lens), num_kv_heads, group, head_dim, block_size, lens)
    got = paged_decode(q, k_cache, v_cache, tables, seq_lens, head_dim**-0.5)
    want = reference(q, k_cache, v_cache, tables, seq_lens, head_dim**-0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("splits", [1, 3])
def test_bfloat16_cache_is_widened_exactly(monkeypatch, splits):
    """A bfloat16 cache (and q) is read as the float32 values it holds, the math is float32 and
    only the output is rounded: the result is the float32 kernel's on the widened inputs,
    rounded to bfloat16 (equal to within one rounding of an output element)."""
    monkeypatch.setattr(cpu_attention, "num_splits", lambda *a: splits)
    lens = [1, 16, 17, 300, 33]
    q, k_cache, v_cache, tables, seq_lens = (
        t.to(torch.bfloat16) if t.is_floating_point() else t for t in random_paged(len(lens), 3, 3, 64, 16, lens)
    )
    got = paged_decode(q, k_cache, v_cache, tables, seq_lens, 0.125)
    assert got.dtype == torch.bfloat16
    wide = [t.float() if t.is_floating_point() else t for t in (q, k_cache, v_cache, tables, seq_lens)]
    want = reference(*wide, 0.125)
    torch.testing.assert_close(got.float(), want, atol=1e-5, rtol=2**-8)
    assert (got.float() - want).abs().max() > 0  # rounded to bfloat16, not kept float32


@pytest.mark.parametrize("splits", [2, 3, 7])
def test_split_rows_equal_unsplit(monkeypatch, splits):
    """Rows cut into key ranges merged afterwards (fewer rows than threads); ranges past a
    short row's end are empty and must not count."""
    monkeypatch.setattr(cpu_attention, "num_splits", lambda *a: splits)
    lens = [300, 5, 16, 33]
    q, k_cache, v_cache, tables, seq_lens = random_paged(len(lens), 3, 3, 64, 16, lens)
    got = paged_decode(q, k_cache, v_cache, tables, seq_lens, 0.125)
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, tables, seq_lens, 0.125), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 2, 5])
@pytest.mark.parametrize("window", [1, 7, 16, 45, 1000])
def test_sliding_window_reads_only_the_last_window_positions(monkeypatch, dtype, splits, window):
    """A window starting mid-block, on a block edge, longer than the row; rows cut into key
    ranges over the window only (ranges past it empty)."""
    monkeypatch.setattr(cpu_attention, "num_splits", lambda *a: splits)
    lens = [300, 5, 16, 33, 1]
    q, k_cache, v_cache, tables, seq_lens = (
        t.to(dtype) if t.is_floating_point() else t for t in random_paged(len(lens), 3, 3, 64, 16, lens, seed=2)
    )
    got = paged_decode(q, k_cache, v_cache, tables, seq_lens, 0.125, window)
    wide = [t.float() if t.is_floating_point() else t for t in (q, k_cache, v_cache, tables, seq_lens)]
    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 1e-5, "rtol": 2**-8}
    torch.testing.assert_close(got.float(), reference(*wide, 0.125, window), **tol)


def capped_reference(q, k_cache, v_cache, tables, lens, scale, softcap, window=None):
    """The eager math transformers' Gemma 2 runs, per row: ``softcap * tanh(scores / softcap)``, then the
    softmax over the row's last ``window`` (or all) positions, on the cache widened to float32."""
    outs = []
    for b, n in enumerate(lens.tolist()):
        lo = max(0, n - window) if window else 0
        keys = k_cache[tables[b].long()].float().flatten(0, 1)[lo:n]  # [n - lo, Hkv, D]
        vals = v_cache[tables[b].long()].float().flatten(0, 1)[lo:n]
        scores = torch.einsum("hgd,khd->hgk", q[b].float(), keys) * scale
        probs = (torch.tanh(scores / softcap) * softcap).softmax(-1)
        outs.append(torch.einsum("hgk,khd->hgd", probs, vals))
    return torch.stack(outs)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize(("splits", "window"), [(1, None), (3, None), (2, 45)])
def test_kernel_caps_scores_on_every_cache_kind(monkeypatch, cache_dtype, splits, window):
    """Gemma 2's attn_logit_softcapping in the kernel: every cache kind (fp8 folds its rebias into the
    scale before the cap), rows cut into key ranges or not, a window; scores of ~N(0, 3) against a
    cap of 2, so the cap bites (the uncapped kernel is far off)."""
    from vllmini.kv.cache_dtype import to_cache

    monkeypatch.setattr(cpu_attention, "num_splits", lambda *a: splits)
    lens = [1, 16, 17, 300, 33]
    q, k_cache, v_cache, tables, seq_lens = random_paged(len(lens), 2, 3, 32, 16, lens, seed=4)
    k_cache, v_cache = to_cache(k_cache, cache_dtype), to_cache(v_cache, cache_dtype)
    q, scale, cap = q * 3, 32**-0.5, 2.0
    got = paged_decode(q, k_cache, v_cache, tables, seq_lens, scale, window, softcap=cap)
    want = capped_reference(q, k_cache, v_cache, tables, seq_lens, scale, cap, window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert (paged_decode(q, k_cache, v_cache, tables, seq_lens, scale, window) - want).abs().max() > 0.1
    with pytest.raises(ValueError, match="softcap must be positive"):
        paged_decode(q, k_cache, v_cache, tables, seq_lens, scale, window, softcap=0.0)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2])
def test_backend_caps_scores_on_mixed_and_static_steps_as_the_torch_backend(cache_dtype):
    """The cpu backend for Gemma 2: prompts, chunks after cached tokens and decode rows (the kernel's), with
    and without a window, as the torch backend caps them (check_backend's steps), over float32, bfloat16
    and fp8 caches; then decode rows through the static path (what a graph replays: gather + eager math)."""
    assert check_backend(cpu_backend, CPU, torch.float32, num_heads=6, num_kv_heads=2, head_dim=16, block_size=4,
                         window=5, cache_dtype=cache_dtype, softcap=0.5) is None  # fmt: skip
    from test_attention import BS, D, build_batch

    q, k, v, cache, meta, *_ = build_batch([1, 1, 1], [5, 1, 13], seed=2)
    eager = cpu_backend(q, k, v, meta, tuple(c.clone() for c in cache), D**-0.5, softcap=0.5)
    cu = torch.arange(4, dtype=torch.int32)
    static = AttentionMetadata.for_static_decode(cu, cu, meta.seq_lens, meta.slot_mapping,
                                                 block_table_tensor(meta.block_tables.tolist(), 6), 6 * BS)  # fmt: skip
    torch.testing.assert_close(cpu_backend(q, k, v, static, tuple(c.clone() for c in cache), D**-0.5, softcap=0.5),
                               eager, atol=1e-5, rtol=1e-5)  # fmt: skip
    assert (cpu_backend(q, k, v, static, tuple(c.clone() for c in cache), D**-0.5) - eager).abs().max() > 0.1


def test_num_splits_only_when_threads_would_idle():
    from vllmini.models.cpu_attention import SPLIT_MIN_BLOCKS, num_splits

    assert num_splits(batch=2, max_blocks=500, threads=2) == 1  # a row per thread already
    assert num_splits(batch=1, max_blocks=500, threads=2) == 2
    assert num_splits(batch=3, max_blocks=500, threads=16) == 6
    assert num_splits(batch=1, max_blocks=SPLIT_MIN_BLOCKS - 1, threads=8) == 1  # too short to pay
    assert num_splits(batch=1, max_blocks=3 * SPLIT_MIN_BLOCKS, threads=8) == 3


def test_kernel_reads_only_the_rows_positions():
    """NaN in every slot no row may read (past a row's end, other blocks) never reaches an output."""
    q, k_cache, v_cache, tables, seq_lens = random_paged(3, 2, 2, 16, 4, [6, 3, 9])
    want = reference(q, k_cache, v_cache, tables, seq_lens, 0.25)
    readable = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for b, n in enumerate(seq_lens.tolist()):
        for p in range(n):
            readable[tables[b, p // 4], p % 4] = True
    k_cache[~readable] = float("nan")
    v_cache[~readable] = float("nan")
    got = paged_decode(q, k_cache, v_cache, tables, seq_lens, 0.25)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_kernel_refuses_what_it_cannot_read():
    q, k_cache, v_cache, tables, seq_lens = random_paged(2, 2, 2, 16, 4, [6, 3])
    with pytest.raises(ValueError, match="float32, bfloat16 or fp8 cache"):
        paged_decode(q, k_cache.double(), v_cache.double(), tables, seq_lens, 0.25)
    with pytest.raises(ValueError, match="float32, bfloat16 or fp8 cache"):
        paged_decode(q, k_cache.half(), v_cache.half(), tables, seq_lens, 0.25)
    with pytest.raises(ValueError, match="float32, bfloat16 or fp8 cache"):
        paged_decode(q, k_cache, v_cache.bfloat16(), tables, seq_lens, 0.25)
    with pytest.raises(ValueError, match="int32"):
        paged_decode(q, k_cache, v_cache, tables.long(), seq_lens, 0.25)
    with pytest.raises(ValueError, match="cache shape"):
        paged_decode(q, k_cache[:, :, :1], v_cache[:, :, :1], tables, seq_lens, 0.25)
    with pytest.raises(ValueError, match="one row per query row"):
        paged_decode(q, k_cache, v_cache, tables[:1], seq_lens, 0.25)
    with pytest.raises(ValueError, match="contiguous"):
        paged_decode(q.transpose(2, 3).contiguous().transpose(2, 3), k_cache, v_cache, tables, seq_lens, 0.25)
    big = torch.zeros(1, 1, 1, 512)
    with pytest.raises(ValueError, match="head_dim=512 > 256"):
        paged_decode(big, torch.zeros(2, 4, 1, 512), torch.zeros(2, 4, 1, 512), tables[:1], seq_lens[:1], 0.1)
    assert paged_decode(q[:0], k_cache, v_cache, tables[:0], seq_lens[:0], 0.25).shape == q[:0].shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_on_mixed_steps_equals_the_torch_backend(dtype):
    """Decode rows next to a chunk after cached tokens and a fresh prompt, all on the paged
    cache: the kernel takes the decode rows, the torch path the rest. In bfloat16 the torch
    path's SDPA rounds its own way, so the two agree to bfloat16's precision."""
    assert check_backend(cpu_backend, CPU, dtype, num_heads=6, num_kv_heads=2, head_dim=16, block_size=4) is None
    assert check_backend(cpu_backend, CPU, dtype, num_heads=6, num_kv_heads=2, head_dim=16, block_size=4, window=5) is None
    q_lens, seq_lens = [1, 4, 1, 3, 1], [9, 11, 1, 3, 30]
    block_size, tables = 4, [[0, 1, 2], [3, 4, 5], [6], [7], [8, 9, 10, 11, 12, 13, 14, 15]]
    slots = [t[p // block_size] * block_size + p % block_size for t, n, ql in zip(tables, seq_lens, q_lens)
             for p in range(n - ql, n)]  # fmt: skip
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(sum(q_lens), h, 16, generator=g).to(dtype) for h in (6, 2, 2))
    cache = [torch.randn(16, block_size, 2, 16, generator=g).to(dtype) for _ in range(2)]
    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 2e-2}
    for window in (None, 6):
        outs = [
            fn(q, k, v, AttentionMetadata.paged(q_lens, seq_lens, slots, tables), tuple(c.clone() for c in cache), 0.25,
               window)
            for fn in (cpu_backend, torch_attention)
        ]  # fmt: skip
        assert outs[0].dtype == dtype
        torch.testing.assert_close(outs[0], outs[1], **tol)


@pytest.fixture
def fresh_build(monkeypatch):
    """The kernel rebuilt under the test's $CC, and rebuilt normally after it."""
    cpu_attention.load_kernel.cache_clear()
    cpu_attention.kernel_limits.cache_clear()
    monkeypatch.setattr(logging.getLogger("vllmini"), "propagate", True)
    yield monkeypatch
    cpu_attention.load_kernel.cache_clear()
    cpu_attention.kernel_limits.cache_clear()


def test_no_compiler_falls_back_to_the_torch_backend(fresh_build, caplog):
    fresh_build.setenv("CC", "/nonexistent/cc")
    with pytest.raises(KernelBuildError, match="/nonexistent/cc"):
        cpu_attention.load_kernel()
    caplog.set_level("WARNING", logger="vllmini")
    name, fn = start_backend(None, CPU, torch.float32, 16, 6, 2, 16)
    assert (name, fn) == ("torch", torch_attention)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cpu failed its start-up check (KernelBuildError" in warnings[0]
    with pytest.raises(ValueError, match="attention_backend='cpu' failed its start-up check: KernelBuildError"):
        start_backend("cpu", CPU, torch.float32, 16, 6, 2, 16)


def test_a_compiler_without_openmp_builds_a_serial_kernel(fresh_build, caplog, tmp_path):
    real_cc = cpu_attention._compiler()
    wrapper = tmp_path / "cc-without-openmp"
    wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && exit 1; done\nexec {real_cc} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    fresh_build.setenv("CC", str(wrapper))
    caplog.set_level("WARNING", logger="vllmini")
    q, k_cache, v_cache, tables, seq_lens = random_paged(3, 2, 2, 16, 4, [6, 3, 13])
    got = paged_decode(q, k_cache, v_cache, tables, seq_lens, 0.25)
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, tables, seq_lens, 0.25), atol=2e-5, rtol=2e-5)
    assert any("without OpenMP" in r.getMessage() for r in caplog.records)


def test_engine_uses_the_kernel_on_cpu_with_the_torch_backends_tokens(tmp_path):
    """Auto on a float32 CPU engine is the cpu backend; its greedy tokens equal the torch
    backend's over prompts whose contexts cross many blocks (the HF-equality tests run on it too)."""
    from transformers import AutoModelForCausalLM

    from bench.random_model import save_word_level_tokenizer
    from vllmini import LLM, SamplingParams

    hf = AutoModelForCausalLM.from_config(tiny_llama_config(), dtype=torch.float32)
    hf.save_pretrained(tmp_path)
    save_word_level_tokenizer(hf.config.vocab_size, tmp_path)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist()}
               for n in (3, 40, 17, 90)]  # fmt: skip
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    tokens = {}
    for backend in (None, "torch"):
        llm = LLM(model=str(tmp_path), kv_cache_memory=2**22, block_size=8, attention_backend=backend)
        tokens[llm.llm_engine.attention_backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.num_blocks
    assert set(tokens) == {"cpu", "torch"}
    assert tokens["cpu"] == tokens["torch"]


def test_loading_the_kernel_keeps_subnormal_floats():
    """Built with -ffast-math but not linked with it: crtfastmath.o would set flush-to-zero for
    the whole process when the library loads (hypothesis's float strategies then refuse to run)."""
    import numpy as np

    cpu_attention.load_kernel()
    assert np.float32(1e-40) * np.float32(1.0) != 0
    assert (torch.tensor([1e-40]) * 1.0).item() != 0


def test_cpu_attention_benchmark_runs_and_checks_its_outputs(tmp_path):
    """``python -m bench.cpu_attention``: both backends on the same inputs, outputs compared
    inside every timed call, a JSON record."""
    import json

    from bench import cpu_attention as bench

    results = bench.main(["--cache-mib", "40", "--iters", "1", "--out", str(tmp_path / "r.json")])
    assert [(r["rows"], tuple(r["context"])) for r in results] == [(n, (lo, hi)) for n, lo, hi in bench.CASES]
    assert all(r["torch_ms"] > 0 and r["cpu_ms"] > 0 and r["speedup"] > 0 for r in results)
    assert json.loads((tmp_path / "r.json").read_text())["cases"] == results


def test_cpu_attention_benchmark_refuses_a_cache_too_small(capsys):
    from bench import cpu_attention as bench

    with pytest.raises(SystemExit):
        bench.main(["--cache-mib", "16", "--iters", "1"])
    assert "--cache-mib 16 holds 1365 blocks; the largest case needs 2816" in capsys.readouterr().err
