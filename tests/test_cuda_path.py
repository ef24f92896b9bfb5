"""The CUDA path's CPU-checkable parts: torch varlen glue against a stand-in with varlen_attn's
documented semantics, backend selection and fallbacks, dtype rules, and the padded static-shape
decode forward (what a CUDA graph replays) against the eager forward."""
from __future__ import annotations

import contextlib
import importlib.abc
import logging
import math
import sys
import types

import pytest
import torch

from helpers import tiny_llama_config, tiny_mistral_config, tiny_qwen3_config, triton_skip_reason
from test_attention import D, MIXES, build_batch, dense_reference
from vllmini.config import resolve_dtype
from vllmini.engine.cuda_graph import PAD_BLOCKS, DecodeGraphRunner, StaticDecodeBuffers, capture_sizes
from vllmini.engine.model_runner import FlatBatch
from vllmini.models.attention import torch_attention, torch_varlen_backend
from vllmini.models.backend_select import get_backend, select_backend
from vllmini.models.base import AttentionMetadata
from vllmini.models.registry import get_model_class

CUDA = torch.device("cuda")  # selection only inspects the device; nothing runs on it


def fake_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):  # fmt: skip
    """torch.nn.attention.varlen.varlen_attn as documented (torch 2.13), written densely:
    (left, 0) windowing = causal aligned bottom-right, keys back to ``left`` positions before the
    query (-1: all); right -1 (no bound) is only accepted where every query is a single token,
    where the two agree; with block_table, key/value are a page pool and seqused_k[i] tokens
    of sequence i are valid."""
    left, right = window_size
    assert (right == 0 or (right == -1 and max_q == 1)) and left >= -1 and enable_gqa
    assert query.dtype == key.dtype
    assert block_table is None or (seqused_k is not None and block_table.dtype == torch.int32)
    out = torch.empty_like(query)
    for i in range(len(cu_seq_q) - 1):
        qs, qe = int(cu_seq_q[i]), int(cu_seq_q[i + 1])
        assert qe - qs <= max_q
        if block_table is None:
            ks, ke = int(cu_seq_k[i]), int(cu_seq_k[i + 1])
            keys, vals = key[ks:ke], value[ks:ke]
        else:
            n = int(seqused_k[i])
            assert n <= max_k
            blocks = block_table[i, : math.ceil(n / key.shape[1])].long()
            keys, vals = key[blocks].flatten(0, 1)[:n], value[blocks].flatten(0, 1)[:n]
        h, hkv = query.shape[1], keys.shape[1]
        k_rep, v_rep = keys.repeat_interleave(h // hkv, 1), vals.repeat_interleave(h // hkv, 1)
        scores = torch.einsum("qhd,khd->hqk", query[qs:qe].float(), k_rep.float()) * scale
        q_len, k_len = qe - qs, keys.shape[0]
        pos_q, pos_k = torch.arange(k_len - q_len, k_len)[:, None], torch.arange(k_len)[None, :]
        allowed = (pos_k <= pos_q) & ((left < 0) | (pos_k >= pos_q - left))
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[qs:qe] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v_rep.float()).to(query.dtype)
    return out


def old_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """The torch 2.10-era schema: no block_table, no GQA."""
    raise AssertionError("must not be called")


def fake_varlen_module(fn) -> types.ModuleType:
    mod = types.ModuleType("torch.nn.attention.varlen")
    mod.varlen_attn = fn
    return mod


# ---- torch varlen glue ---------------------------------------------------------------------
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_torch_varlen_glue_passes_paged_metadata(mix, window):
    q_lens, seq_lens = MIXES[mix]
    q, k, v, cache, meta, hk, hv = build_batch(q_lens, seq_lens, seed=3)
    cache_copy = (cache[0].clone(), cache[1].clone())
    out = torch_varlen_backend(fake_varlen_attn)(q, k, v, meta, cache, D**-0.5, window)
    ref = torch_attention(q, k, v, AttentionMetadata.paged(q_lens, seq_lens, meta.slot_mapping.tolist(),
                                                           meta.block_tables.tolist()), cache_copy, D**-0.5, window)  # fmt: skip
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache[0], cache_copy[0])  # same K/V written at the same slots
    start = 0
    for ql, k_seq, v_seq in zip(q_lens, hk, hv):
        want = dense_reference(q[start : start + ql], k_seq, v_seq, D**-0.5, window)
        torch.testing.assert_close(out[start : start + ql], want, atol=1e-5, rtol=1e-5)
        start += ql


def test_torch_varlen_glue_without_cache():
    lens = [3, 7, 1]
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(sum(lens), n, D, generator=g) for n in (6, 2, 2))
    meta = AttentionMetadata.for_prompts(lens)
    out = torch_varlen_backend(fake_varlen_attn)(q, k, v, meta, None, 0.3)
    torch.testing.assert_close(out, torch_attention(q, k, v, meta, None, 0.3), atol=1e-5, rtol=1e-5)


def test_torch_varlen_schema_check():
    assert torch_varlen_backend(fake_varlen_attn) is not None
    assert torch_varlen_backend(old_varlen_attn) is None  # no block_table: cannot read a paged cache
    assert torch_varlen_backend(len) is None  # any other callable: refused, not raised on


# ---- backend selection ----------------------------------------------------------------------
@pytest.fixture
def vllmini_log(monkeypatch, caplog):
    monkeypatch.setattr(logging.getLogger("vllmini"), "propagate", True)  # let caplog see our records
    caplog.set_level("INFO", logger="vllmini")
    return caplog


def _no_flash(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import raises ImportError


def test_auto_order_on_cuda(monkeypatch, vllmini_log):
    from test_attention import _fake_flash_module, set_triton

    set_triton(monkeypatch, present=False)
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_module())
    assert select_backend(None, CUDA, torch.bfloat16, 256) == "flash_attn"
    _no_flash(monkeypatch)
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", fake_varlen_module(fake_varlen_attn))
    assert select_backend(None, CUDA, torch.bfloat16, 256) == "torch_varlen"
    assert "flash-attn is not importable" in vllmini_log.text
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", fake_varlen_module(old_varlen_attn))
    assert select_backend(None, CUDA, torch.bfloat16, 256) == "torch"
    # auto never picks a FlashAttention backend that the block size or dtype rules out
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", fake_varlen_module(fake_varlen_attn))
    assert select_backend(None, CUDA, torch.bfloat16, 16) == "torch"
    assert select_backend(None, CUDA, torch.float32, 256) == "torch"
    assert select_backend(None, torch.device("cpu"), torch.float16, 256) == "torch"
    # with triton: after the FlashAttention backends, before SDPA over gathered blocks
    set_triton(monkeypatch, present=True)
    assert select_backend(None, CUDA, torch.bfloat16, 256) == "torch_varlen"
    assert select_backend(None, CUDA, torch.bfloat16, 16) == "triton"
    assert select_backend(None, CUDA, torch.float32, 256) == "triton"
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", fake_varlen_module(old_varlen_attn))
    vllmini_log.clear()
    assert select_backend(None, CUDA, torch.bfloat16, 256) == "triton"  # torch 2.11 without flash-attn
    assert [r.levelname for r in vllmini_log.records] == ["WARNING", "INFO"]  # one warning, then the choice
    assert select_backend(None, torch.device("cpu"), torch.float16, 256) == "torch"


def test_forced_triton(monkeypatch):
    from test_attention import set_triton

    set_triton(monkeypatch, present=True)
    assert select_backend("triton", CUDA, torch.float32, 16) == "triton"  # any dtype, any block size
    assert select_backend("triton", CUDA, torch.bfloat16, 256) == "triton"
    with pytest.raises(ValueError, match="'triton' cannot be used: it needs a CUDA device"):
        select_backend("triton", torch.device("cpu"), torch.float32, 16)
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", fake_varlen_module(old_varlen_attn))
    assert select_backend("torch_varlen", CUDA, torch.bfloat16, 256) == "triton"  # its fallback, with a warning
    set_triton(monkeypatch, present=False)
    with pytest.raises(ValueError, match="'triton' but triton is not importable"):
        select_backend("triton", CUDA, torch.bfloat16, 256)


def test_forced_backends_name_their_constraint(monkeypatch, vllmini_log):
    from test_attention import set_triton

    set_triton(monkeypatch, present=False)
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", fake_varlen_module(fake_varlen_attn))
    with pytest.raises(ValueError, match="'torch_varlen' cannot be used.*block_size to be a multiple of 256 \\(got 16\\)"):
        select_backend("torch_varlen", CUDA, torch.bfloat16, 16)
    with pytest.raises(ValueError, match="'flash_attn' cannot be used.*float16/bfloat16 only \\(got torch.float32"):
        select_backend("flash_attn", CUDA, torch.float32, 256)
    with pytest.raises(ValueError, match="'torch_varlen' cannot be used: it needs a CUDA device"):
        select_backend("torch_varlen", torch.device("cpu"), torch.bfloat16, 256)
    assert select_backend("torch_varlen", CUDA, torch.float16, 512) == "torch_varlen"  # fp16 accepted
    assert select_backend("torch", CUDA, torch.float32, 16) == "torch"  # the torch backend takes anything
    _no_flash(monkeypatch)
    with pytest.raises(ValueError, match="flash-attn .* is not importable"):
        select_backend("flash_attn", CUDA, torch.bfloat16, 256)
    # forced torch_varlen on a torch whose varlen_attn has no block_table: SDPA over gathered blocks
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", fake_varlen_module(old_varlen_attn))
    assert select_backend("torch_varlen", CUDA, torch.bfloat16, 256) == "torch"
    assert "no paged varlen_attn" in vllmini_log.text
    with pytest.raises(ValueError, match="attention_backend='nope' is not one of"):
        select_backend("nope", CUDA, torch.bfloat16, 256)


class _AbiBrokenFinder(importlib.abc.MetaPathFinder):
    """What a flash-attn wheel built for another torch does at import."""

    def find_spec(self, name, path, target=None):
        if name == "flash_attn" or name.startswith("flash_attn."):
            raise ImportError("flash_attn_2_cuda.cpython-312-x86_64-linux-gnu.so: undefined symbol: _ZN3c104cuda9SetDevice")
        return None


def _lazy_broken_flash() -> types.ModuleType:
    mod = types.ModuleType("flash_attn")

    def __getattr__(name):
        raise OSError("libcudart.so.12: cannot open shared object file")

    mod.__getattr__ = __getattr__
    return mod


@pytest.mark.parametrize("breakage", ["abi-import-error", "lazy-load-error"])
def test_broken_flash_attn_falls_back_with_one_warning(monkeypatch, vllmini_log, breakage):
    from test_attention import set_triton

    set_triton(monkeypatch, present=True)
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", fake_varlen_module(fake_varlen_attn))
    if breakage == "abi-import-error":
        monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
        monkeypatch.setattr(sys, "meta_path", [_AbiBrokenFinder(), *sys.meta_path])
    else:
        monkeypatch.setitem(sys.modules, "flash_attn", _lazy_broken_flash())
    assert select_backend(None, CUDA, torch.bfloat16, 256) == "torch_varlen"
    warnings = [r for r in vllmini_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "flash-attn is not importable" in warnings[0].getMessage()


def test_get_backend():
    assert get_backend("torch") is torch_attention
    if torch_varlen_backend() is not None:  # torch >= 2.12-ish: varlen_attn reads a block table
        assert callable(get_backend("torch_varlen"))
    else:  # e.g. torch 2.11 (the GPU machine's)
        with pytest.raises(ValueError, match="'torch_varlen' needs .*varlen_attn with block_table"):
            get_backend("torch_varlen")
    with pytest.raises(ValueError, match="not one of"):
        get_backend("nope")
    pytest.importorskip("triton")
    assert get_backend("triton").__name__ == "triton_attention"


def test_dtype_rules():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", CUDA) == torch.bfloat16
    assert resolve_dtype("fp16", CUDA) == torch.float16
    assert resolve_dtype("float32", CUDA) == torch.float32  # allowed with the torch backend
    with pytest.raises(ValueError, match="float16/bfloat16 only"):
        select_backend("flash_attn", CUDA, resolve_dtype("float32", CUDA), 256)


# ---- padded static decode (what a CUDA graph replays) == eager --------------------------------
def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 32]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(256)[-1] == 256 and len(capture_sizes(256)) == 20


def test_static_buffers_pad_rows():
    buf = StaticDecodeBuffers.allocate(8, 4, torch.device("cpu"))
    flat = FlatBatch([5, 6, 7], [9, 0, 20], [36 + 9, 2 * 4, 7 * 4 + 20 % 4], [1, 1, 1], [10, 1, 21],
                     [[9, 8, 7], [2], [1, 3, 5, 7]], [0, 1, 2], [0, 1, 2])  # fmt: skip
    buf.fill(flat, 4, pad_block=11, block_size=4)
    assert buf.input_ids[:4].tolist() == [5, 6, 7, 0]
    assert buf.slot_mapping[:4].tolist() == [45, 8, 28, 44]  # the pad row writes into the pad block
    assert buf.seq_lens[:4].tolist() == [10, 1, 21, 1]
    assert buf.cu_seqlens_k[:5].tolist() == [0, 10, 11, 32, 33]
    assert buf.block_tables[:4].tolist() == [[9, 8, 7, 0], [2, 0, 0, 0], [1, 3, 5, 7], [11, 0, 0, 0]]
    meta = buf.metadata(4, 4)
    assert meta.static_decode and meta.max_seqlen_k == 16 and meta.num_seqs == 4
    assert meta.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]


def _random_model(config, backend):
    torch.manual_seed(0)
    model = get_model_class(config.architectures)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.set_attention_backend(backend)
    return model


def _decode_state(model, batch: int, block_size: int, max_model_len: int, seed: int):
    """A paged cache holding ``batch`` sequences of varied lengths (prefilled for real), and the
    decode step that follows (one new token each), as a FlatBatch."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_model_len - 1, (batch,), generator=g).tolist()
    lens[0] = max_model_len - 1  # one sequence fills its block table to the last block
    blocks_per_seq = -(-max_model_len // block_size)
    num_blocks = blocks_per_seq * batch
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [perm[i * blocks_per_seq : i * blocks_per_seq + -(-(n + 1) // block_size)] for i, n in enumerate(lens)]
    shape = (num_blocks + PAD_BLOCKS, block_size, model.num_kv_heads, model.head_dim)
    p = next(model.parameters())
    caches = [(torch.zeros(shape, dtype=p.dtype), torch.zeros(shape, dtype=p.dtype)) for _ in model.model.layers]
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in lens]
    slots = [t[i // block_size] * block_size + i % block_size for t, n in zip(tables, lens) for i in range(n)]
    meta = AttentionMetadata.paged(lens, lens, slots, tables)
    ids = torch.tensor([t for pr in prompts for t in pr])
    with torch.no_grad():
        model(ids, torch.cat([torch.arange(n) for n in lens]), meta, caches)
    new = torch.randint(0, model.config.vocab_size, (batch,), generator=g).tolist()
    flat = FlatBatch(
        ids=new, positions=list(lens),
        slots=[t[n // block_size] * block_size + n % block_size for t, n in zip(tables, lens)],
        query_lens=[1] * batch, seq_lens=[n + 1 for n in lens], block_tables=tables,
        logits_rows=list(range(batch)), sample_indices=list(range(batch)),
    )  # fmt: skip
    return caches, flat, num_blocks


def _static_cases() -> list:
    """(arch, backend) pairs; the windowed model skips the split Triton launch (30 s in the
    interpreter; tests/test_triton_attention.py checks split shares under a window)."""
    triton = pytest.mark.skipif(triton_skip_reason(cpu_tensors=True) is not None,
                                reason=str(triton_skip_reason(cpu_tensors=True)))  # fmt: skip
    cases = []
    for arch in ("llama", "qwen3", "mistral-window"):
        for backend in ("torch", "torch_varlen", "triton", "triton-split"):
            if (arch, backend) != ("mistral-window", "triton-split"):
                cases.append(pytest.param(arch, backend, marks=[triton] if backend.startswith("triton") else []))
    return cases


@pytest.mark.parametrize(("arch", "backend"), _static_cases())
def test_padded_static_decode_equals_eager(arch, backend, monkeypatch):
    """What a CUDA graph replays (rows padded to the captured size, block tables as wide as
    max_model_len, padding rows in the pad block) == the eager step, for every backend.
    ``triton-split``: the static step splits each row's keys (as it would on a GPU with idle
    SMs; a graph does not know the contexts, so most shares are empty here), the eager one not."""
    block_size, max_model_len = 4, 40
    # padded to 4, 8 and 32 rows; the Triton kernel runs in its interpreter here, whose time grows
    # with the rows: it takes the two smaller sizes (its programs are per row; the torch backends
    # cover padding past 16 rows)
    batches = (3, 5, 17) if not backend.startswith("triton") else (3, 5)
    if arch == "mistral-window":  # sliding-window attention (7 keys) in every layer
        config = tiny_mistral_config(max_position_embeddings=64, sliding_window=7)
    else:
        config = (tiny_llama_config if arch == "llama" else tiny_qwen3_config)(max_position_embeddings=64)
    if backend == "triton-split":
        import vllmini.models.triton_attention as ta

        # > rows x KV heads at every padded size, so every static launch splits (few SMs: the
        # interpreter's time grows with programs)
        monkeypatch.setattr(ta, "_num_sms", lambda device: 32)
        splits, real_run_launch = [], ta.run_launch

        def run_launch(launch, *args, **kw):
            splits.append(launch.num_splits)
            return real_run_launch(launch, *args, **kw)

        monkeypatch.setattr(ta, "run_launch", run_launch)
    fn = {"torch": lambda: torch_attention, "torch_varlen": lambda: torch_varlen_backend(fake_varlen_attn),
          "triton": lambda: get_backend("triton"), "triton-split": lambda: get_backend("triton")}[backend]()  # fmt: skip
    model = _random_model(config, fn)
    for batch in batches:
        caches, flat, num_blocks = _decode_state(model, batch, block_size, max_model_len, seed=batch)
        static_caches = [(k.clone(), v.clone()) for k, v in caches]
        with torch.no_grad():
            ref = model(*[torch.tensor(x) for x in (flat.ids, flat.positions)], flat.to_model_input("cpu").attn_metadata, caches)
        runner = DecodeGraphRunner(model, static_caches, block_size, 20, max_model_len, num_blocks,
                                   torch.device("cpu"), use_graphs=False)  # fmt: skip
        assert runner.can_run(flat) and runner.padded_size(batch) > batch
        out = runner.run(flat)
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        assert torch.equal(out.argmax(-1), ref.argmax(-1))
        if backend == "triton-split":  # eager steps: one share (short contexts); padded static ones: split
            assert 1 in splits and max(splits) > 1
            splits.clear()
        for (k, v), (sk, sv) in zip(caches, static_caches):  # same K/V written; padding only in the pad block
            torch.testing.assert_close(sk[:num_blocks], k[:num_blocks])
            torch.testing.assert_close(sv[:num_blocks], v[:num_blocks])


def test_graph_runner_refuses_what_it_cannot_replay():
    model = _random_model(tiny_llama_config(), torch_attention)
    runner = DecodeGraphRunner(model, [], 4, 8, 40, 0, torch.device("cpu"), use_graphs=False)
    decode = FlatBatch([1, 2], [3, 4], [3, 4], [1, 1], [4, 5], [[0], [1, 2]], [0, 1], [0, 1])
    assert runner.can_run(decode)
    prefill = FlatBatch([1, 2], [0, 1], [0, 1], [2], [2], [[0]], [1], [0])
    assert not runner.can_run(prefill)
    partial = FlatBatch([1], [0], [0], [1], [1], [[0]], [], [])  # a 1-token chunk that samples nothing
    assert not runner.can_run(partial)
    too_many = FlatBatch(*([[1] * 9] * 5), [[0]] * 9, list(range(9)), list(range(9)))
    assert not runner.can_run(too_many)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        DecodeGraphRunner(model, [], 4, 8, 40, 0, torch.device("cpu"), use_graphs=True)


def test_graph_capture_and_its_memory_reserve_use_one_side_stream(monkeypatch):
    """Every size's warm-up and capture, and the forward that sizes the graphs' memory reserve,
    run on one side stream: cuBLAS takes a workspace per stream from torch's allocator on its
    first matmul and keeps it (32 MiB on sm_90), so a stream per size (20 at max_num_seqs=256)
    would hold 640 MiB outside the KV budget. torch.cuda is faked: this records the streams."""
    from vllmini.engine import cuda_graph

    created, entered, captured_on = [], [], []

    class Stream:
        def __init__(self, device=None):
            created.append(self)

        def wait_stream(self, other):
            pass

    class Graph:
        def pool(self):
            return ("pool",)

    @contextlib.contextmanager
    def on_stream(stream):
        entered.append(stream)
        yield

    @contextlib.contextmanager
    def capture(graph, pool=None, stream=None):
        captured_on.append(stream)
        yield

    default = object.__new__(Stream)  # the current stream (not created through Stream())
    for name, value in dict(Stream=Stream, stream=on_stream, graph=capture, CUDAGraph=Graph,
                            current_stream=lambda device=None: default, synchronize=lambda device=None: None,
                            reset_peak_memory_stats=lambda device=None: None, memory_allocated=lambda device=None: 0,
                            max_memory_allocated=lambda device=None: 0).items():  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, value)
    cuda_graph.graph_stream.cache_clear()
    try:
        model = _random_model(tiny_llama_config(), torch_attention)
        shape = (11, 4, model.num_kv_heads, model.head_dim)
        caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in model.model.layers]
        DecodeGraphRunner.activation_bytes(model, shape, torch.float32, len(caches), 20, 40, torch.device("cpu"))
        runner = DecodeGraphRunner(model, caches, 4, 20, 40, 10, torch.device("cpu"), use_graphs=False)
        runner.use_graphs = True  # the capture path, with the faked torch.cuda
        runner.capture()
    finally:
        cuda_graph.graph_stream.cache_clear()
    assert sorted(runner.graphs) == [1, 2, 4, 8, 16, 32]
    assert len(created) == 1 and entered == created * 7 and captured_on == created * 6


def test_engine_steps_through_the_graph_runner(tmp_path):
    """LLMEngine with its runner's decode steps routed through DecodeGraphRunner (eager static
    mode, as on CUDA minus the replay): the same greedy tokens as the plain eager engine,
    with and without preemption-free mixed prefill/decode steps."""
    from bench.random_model import save_random_model, tiny_qwen3_bench_config
    from vllmini import LLM, SamplingParams

    model_dir = save_random_model(tiny_qwen3_bench_config(initializer_range=0.3), tmp_path / "m", torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (3, 40, 17, 1, 25)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (9, 5, 12, 7, 3)]
    kw = dict(model=str(model_dir), max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64, kv_cache_memory=2**20)

    def generate(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    expected = generate(LLM(**kw))
    llm = LLM(**kw)
    calls = route_decodes_through_graph_runner(llm, max_num_seqs=8, max_model_len=64)
    assert generate(llm) == expected
    assert calls and max(calls) > 1, "no decode step went through the graph runner"


def route_decodes_through_graph_runner(llm, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Give a CPU engine what a CUDA one has (a pad block, a DecodeGraphRunner in eager static
    mode); returns the list that records the batch size of every decode step it runs."""
    from vllmini.kv.cache import KVCacheSpec, allocate_kv_cache

    eng, runner = llm.llm_engine, llm.llm_engine.runner
    spec = KVCacheSpec(len(runner.kv_caches), eng.model.num_kv_heads, eng.model.head_dim, runner.block_size, eng.dtype)
    runner.kv_caches = allocate_kv_cache(spec, eng.num_blocks + PAD_BLOCKS, runner.device)
    runner.decode_graphs = DecodeGraphRunner(eng.model, runner.kv_caches, runner.block_size, max_num_seqs,
                                             max_model_len, eng.num_blocks, runner.device, use_graphs=False)  # fmt: skip
    calls: list[int] = []
    original = runner.decode_graphs.run
    runner.decode_graphs.run = lambda flat, token_ids=None: calls.append(flat.num_seqs) or original(flat, token_ids)
    return calls


def test_failed_graph_capture_leaves_an_eager_engine(monkeypatch, vllmini_log):
    """capture_decode_graphs on a runner whose capture raises (as an op that cannot be captured
    does): no runner, one warning, and nothing raised; a capture that works gives the runner."""
    from vllmini.engine import cuda_graph

    class Runner(DecodeGraphRunner):
        fail = True

        def __init__(self, *args, **kwargs):
            super().__init__(*args[:-1], torch.device("cpu"), use_graphs=False, **kwargs)
            self.sizes = [1, 2]

        def capture(self):
            if Runner.fail:
                raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graph, "DecodeGraphRunner", Runner)
    model = _random_model(tiny_llama_config(), torch_attention)
    args = (model, [], 4, 2, 40, 0, torch.device("cpu"))
    assert cuda_graph.capture_decode_graphs(*args) is None
    warnings = [r.getMessage() for r in vllmini_log.records if r.levelno == logging.WARNING]
    assert warnings == ["CUDA graph capture failed (RuntimeError: operation not permitted when stream is capturing); "
                        "decode steps run eagerly"]  # fmt: skip
    Runner.fail = False
    assert isinstance(cuda_graph.capture_decode_graphs(*args), Runner)
    assert "captured 2 decode CUDA graphs" in vllmini_log.text
