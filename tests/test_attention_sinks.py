"""gpt-oss's attention sinks (a learned logit per query head that joins the softmax as a column whose
value row is zero) on every CPU backend, against transformers' own ``eager_attention_forward`` from
modeling_gpt_oss: prompts, decode rows, chunks after cached tokens, sliding windows, GQA, float32 and
bfloat16, the C kernel's cache kinds and split rows, the static (CUDA-graph) decode path, extreme sinks;
then which backends an engine gets for a model with sinks, and which it refuses by name; last, the engine
over a decoder with ``attn_sinks`` against transformers with gpt-oss's attention. The Triton
kernel's sinks are tested in test_triton_attention.py (interpreter) and test_triton_compile.py (sm_90)."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from test_attention import BS, D, H, HKV, MIXES, _fake_flash_module, build_batch, set_triton
from test_cpu_attention import random_paged
from test_gemma_softcap import capped_varlen_attn, log  # noqa: F401 (log: a fixture)
from vllmini.kv.cache_dtype import to_cache
from vllmini.models import backend_select, cpu_attention as cpu_module
from vllmini.models.attention import Attention, torch_attention, torch_varlen_backend
from vllmini.models.backend_check import check_backend
from vllmini.models.backend_select import select_backend
from vllmini.models.base import AttentionMetadata, block_table_tensor
from vllmini.models.cpu_attention import CACHE_DTYPES, cpu_attention, paged_decode

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # (CUDA: selection only, no device is touched)
BACKENDS = {"torch": torch_attention, "cpu": cpu_attention}
SINKS = torch.linspace(-1.0, 3.0, H)  # from a small share of each softmax to most of it


def sink_reference(q_seq, k_seq, v_seq, scale, sinks, window=None, softcap=None):
    """transformers' gpt-oss eager attention of ``q_seq [q, H, D]`` over ``k/v_seq [L, Hkv, D]`` (lower-right
    causal, the last ``window`` positions when given; ``softcap``: scores capped first), in float32."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q_len, seq_len = q_seq.shape[0], k_seq.shape[0]
    pos_q, pos_k = torch.arange(seq_len - q_len, seq_len)[:, None], torch.arange(seq_len)[None, :]
    seen = (pos_k <= pos_q) & (pos_k > pos_q - (window or seq_len))
    mask = torch.zeros(q_len, seq_len).masked_fill(~seen, float("-inf"))[None, None]
    module = types.SimpleNamespace(num_key_value_groups=q_seq.shape[1] // k_seq.shape[1], sinks=sinks.float(),
                                   training=False)  # fmt: skip
    q, k, v = (t.float().transpose(0, 1)[None] for t in (q_seq, k_seq, v_seq))
    if softcap is None:
        return eager_attention_forward(module, q, k, v, mask, scale)[0][0]
    # (no transformers model both caps and sinks: Gemma 2's cap, then gpt-oss's softmax with the sink column)
    group = q.shape[1] // k.shape[1]
    scores = torch.tanh(torch.matmul(q, k.repeat_interleave(group, 1).transpose(2, 3)) * scale / softcap) * softcap
    sink = module.sinks.view(1, -1, 1, 1).expand(1, -1, q_len, 1)
    probs = torch.cat([scores + mask, sink], -1).softmax(-1)[..., :-1]
    return torch.matmul(probs, v.repeat_interleave(group, 1))[0].transpose(0, 1)


def nan_unread(cache, meta, seq_lens):
    """The caches with NaN in every slot no row may read (another sequence's stale block, a row's tail)."""
    k_cache, v_cache = (c.clone() for c in cache)
    readable = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for b, n in enumerate(seq_lens):
        for p in range(n):
            readable[meta.block_tables[b, p // BS], p % BS] = True
    k_cache[~readable], v_cache[~readable] = float("nan"), float("nan")
    return k_cache, v_cache


def per_sequence(out, q, hk, hv, q_lens, sinks, window=None, softcap=None):
    """The largest |out - reference| over the sequences of a step, and the reference rows."""
    worst, refs, start = 0.0, [], 0
    for q_len, k_seq, v_seq in zip(q_lens, hk, hv):
        ref = sink_reference(q[start : start + q_len], k_seq, v_seq, D**-0.5, sinks, window, softcap)
        worst = max(worst, (out[start : start + q_len].float() - ref).abs().max().item())
        refs.append(ref)
        start += q_len
    return worst, torch.cat(refs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_backends_equal_transformers_eager_math(backend, mix, window, dtype):
    """Decode rows (the torch backend's gather + eager math, the cpu backend's kernel), whole prompts and
    chunks after cached tokens (SDPA's fused kernel with the sink as a key), GQA (6 heads over 2), with
    and without a window, float32 and bfloat16; NaN in slots no row may read stays out."""
    q_lens, seq_lens = MIXES[mix]
    q, k, v, cache, meta, hk, hv = build_batch(q_lens, seq_lens, seed=3)
    q, k, v, hk, hv = ([t.to(dtype) for t in x] if isinstance(x, list) else x.to(dtype) for x in (q, k, v, hk, hv))
    cache = tuple(c.to(dtype) for c in nan_unread(cache, meta, seq_lens))
    sinks = SINKS.to(dtype)
    out = BACKENDS[backend](q, k, v, meta, cache, D**-0.5, window, sinks=sinks)
    worst, ref = per_sequence(out, q, hk, hv, q_lens, sinks, window)
    assert worst < (2e-6 if dtype == torch.float32 else 1.5e-2), worst
    meta.backend_plan = None  # (the cpu backend's plan is not the torch backend's)
    plain = torch_attention(q, k, v, meta, tuple(c.clone() for c in cache), D**-0.5, window)
    assert (plain.float() - ref).abs().max() > 0.1  # (the sinks matter here)


@pytest.mark.parametrize(("backend", "dtype"), [("torch", torch.float32), ("cpu", torch.float32),
                                               ("torch", torch.float16)])  # fmt: skip
def test_extreme_sinks(backend, dtype):
    """A sink far above every score takes the whole softmax (output 0); one far below, or -inf, none of it:
    the output is SDPA's without sinks. float16 (the torch backend's, on a CPU): its sink logits / scale
    overflow unless bounded."""
    q_lens, seq_lens = MIXES["mixed"]
    q, k, v, cache, meta, hk, hv = build_batch(q_lens, seq_lens, seed=6)
    q, k, v, cache = q.to(dtype), k.to(dtype), v.to(dtype), tuple(c.to(dtype) for c in cache)
    plain = torch_attention(q, k, v, meta, tuple(c.clone() for c in cache), D**-0.5)
    for value in (-1e30, float("-inf"), -200.0, -1e4):
        meta.backend_plan = None
        sinks = torch.full((H,), value).to(dtype)
        out = BACKENDS[backend](q, k, v, meta, tuple(c.clone() for c in cache), D**-0.5, sinks=sinks)
        torch.testing.assert_close(out, plain, atol=1e-6 if dtype == torch.float32 else 2e-3, rtol=1e-6)
    for value in (80.0, 1e4, float("inf") if dtype == torch.float16 else 1e30):
        meta.backend_plan = None
        sinks = torch.full((H,), value).to(dtype)
        huge = BACKENDS[backend](q, k, v, meta, tuple(c.clone() for c in cache), D**-0.5, sinks=sinks)
        assert huge.float().abs().max() < 1e-20, value


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize(("splits", "window"), [(1, None), (3, None), (7, None), (2, 45), (5, 45)])
def test_kernel_sinks_on_every_cache_kind_and_split(monkeypatch, cache_dtype, splits, window):
    """The C kernel's online softmax starts from the sink: every cache kind, rows cut into key ranges (the
    sink counted in one range of a row only; 7 ranges leave the short rows' later ranges empty), a window
    starting mid-block; float32 and bfloat16 q."""
    monkeypatch.setattr(cpu_module, "num_splits", lambda *a: splits)
    lens = [300, 5, 16, 33, 1]
    q, k_cache, v_cache, tables, seq_lens = random_paged(len(lens), 2, 3, 32, 16, lens, seed=5)
    k_cache, v_cache = to_cache(k_cache, cache_dtype), to_cache(v_cache, cache_dtype)
    sinks = torch.linspace(0.0, 4.0, 6)
    for q_dtype in (torch.float32, torch.bfloat16):
        qd = q.to(q_dtype)
        got = paged_decode(qd, k_cache, v_cache, tables, seq_lens, 32**-0.5, window, sinks=sinks.to(q_dtype))
        want = torch.stack([
            sink_reference(qd[b].float().reshape(1, 6, 32), k_cache[tables[b].long()].float().flatten(0, 1)[:n],
                           v_cache[tables[b].long()].float().flatten(0, 1)[:n], 32**-0.5, sinks.to(q_dtype),
                           window)[0].view(2, 3, 32)
            for b, n in enumerate(lens)
        ])  # fmt: skip
        tol = 2e-6 if q_dtype == torch.float32 else 2**-8
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert (paged_decode(q, k_cache, v_cache, tables, seq_lens, 32**-0.5, window) - want).abs().max() > 0.1
    with pytest.raises(ValueError, match="one logit per query head"):
        paged_decode(q, k_cache, v_cache, tables, seq_lens, 32**-0.5, sinks=sinks[:3])


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_static_decode_path(backend, window):
    """Decode rows over all of a padded table's columns (what a CUDA graph replays: gather + eager math on
    both backends) equal the eager step's rows and transformers' math."""
    q_lens, seq_lens = MIXES["decodes"]
    q, k, v, cache, meta, hk, hv = build_batch(q_lens, seq_lens, seed=8)
    cache = nan_unread(cache, meta, seq_lens)
    cu = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    static = AttentionMetadata.for_static_decode(cu, cu, meta.seq_lens, meta.slot_mapping,
                                                 block_table_tensor(meta.block_tables.tolist(), 8), 8 * BS)  # fmt: skip
    got = BACKENDS[backend](q, k, v, static, tuple(c.clone() for c in cache), D**-0.5, window, sinks=SINKS)
    eager = BACKENDS[backend](q, k, v, meta, tuple(c.clone() for c in cache), D**-0.5, window, sinks=SINKS)
    torch.testing.assert_close(got, eager, atol=1e-6, rtol=1e-6)
    assert per_sequence(got, q, hk, hv, q_lens, SINKS, window)[0] < 2e-6


def test_sinks_with_a_softcap_too():
    """No model has both, but the eager tiles take both: the cap, then the softmax with the sink."""
    q_lens, seq_lens = MIXES["mixed"]
    q, k, v, cache, meta, hk, hv = build_batch(q_lens, seq_lens, seed=9)
    for backend in BACKENDS.values():
        meta.backend_plan = None
        out = backend(q, k, v, meta, tuple(c.clone() for c in cache), D**-0.5, 5, softcap=0.5, sinks=SINKS)
        assert per_sequence(out, q, hk, hv, q_lens, SINKS, 5, softcap=0.5)[0] < 2e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mix", ["prefills", "chunk-after-cache"])
def test_prefill_with_sinks_takes_sdpas_fused_cpu_kernel(mix, dtype):
    """The sink as one more key keeps prompt chunks on SDPA's fused CPU kernel (eager math in tiles was
    1.3-2x slower at 512-2048 tokens; SDPA's math path builds every score)."""
    q_lens, seq_lens = MIXES[mix]
    q, k, v, cache, meta, _, _ = build_batch(q_lens, seq_lens)
    q, k, v, cache = q.to(dtype), k.to(dtype), v.to(dtype), tuple(c.to(dtype) for c in cache)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch_attention(q, k, v, meta, cache, D**-0.5, sinks=SINKS.to(dtype))
    ops = {event.key for event in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
    assert "aten::_scaled_dot_product_attention_math" not in ops


@pytest.mark.parametrize("q_first", [0, 3])
def test_bfloat16_sink_logits_keep_their_precision(q_first):
    """In a 16-bit dtype the sink's query dimension holds sinks / scale in two halves: one bfloat16 would
    round it to 8 bits (sinks of 8-16 at scale 8**-0.5: up to 4% off in exp(sink)). Queries of zeros see
    scores of 0, so each output is (sum of visible values) / (visible keys + exp(sink)), dominated by the
    sink; whole prompts (causal SDPA) and a chunk after 3 cached keys (masked)."""
    from vllmini.models.eager_attention import prefill

    g = torch.Generator().manual_seed(0)
    sinks = torch.linspace(8.0, 16.0, H).to(torch.bfloat16)
    q = torch.zeros(1, H, 4, D, dtype=torch.bfloat16)
    k, v = (torch.randn(1, HKV, q_first + 4, D, generator=g).to(torch.bfloat16) for _ in range(2))
    out = prefill(q, k, v, D**-0.5, q_first, 0, None, sinks=sinks).double()
    seen = torch.arange(q_first + 4)[None, :] <= torch.arange(q_first, q_first + 4)[:, None]  # [4, L]
    vals = v.double().repeat_interleave(H // HKV, 1)[0]  # [H, L, D]
    denom = seen.sum(-1).double()[None, :] + sinks.double().exp()[:, None]  # [H, 4]
    want = torch.matmul(seen.double(), vals) / denom[..., None]
    assert ((out[0] - want).abs() / want.abs().clamp_min(1e-30)).max() < 8e-3


def test_attention_module_hands_its_sinks_to_the_cpu_backend():
    """``Attention.forward(..., sinks)`` (what a decoder layer with ``attn_sinks`` calls) over an fp8 cache."""
    q_lens, seq_lens = MIXES["mixed"]
    q, k, v, cache, meta, hk, hv = build_batch(q_lens, seq_lens, seed=10)
    attn = Attention(H, HKV, D, D**-0.5)
    attn.backend = cpu_attention
    cache = tuple(to_cache(c, torch.float8_e5m2) for c in cache)
    out = attn(q, k, v, meta, cache, SINKS).view(-1, H, D)
    widened = [to_cache(t, torch.float8_e5m2).float() for t in hk], [to_cache(t, torch.float8_e5m2).float() for t in hv]
    assert per_sequence(out, q, *widened, q_lens, SINKS)[0] < 2e-6


def drops_the_sinks(q, k, v, meta, kv_cache, scale, window=None, sinks=None):
    return torch_attention(q, k, v, meta, kv_cache, scale, window)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_start_up_check_exercises_sinks(cache_dtype):
    """check_backend gives both backends the same random sinks: the cpu backend passes on every kind of
    step (window or not), one that drops them fails on each."""
    shapes = dict(num_heads=6, num_kv_heads=2, head_dim=16, block_size=4, window=5, cache_dtype=cache_dtype)
    assert check_backend(cpu_attention, CPU, torch.float32, **shapes, sinks=True) is None
    assert check_backend(drops_the_sinks, CPU, torch.float32, **shapes) is None  # (no sinks: no difference)
    problem = check_backend(drops_the_sinks, CPU, torch.float32, **shapes, sinks=True)
    for kind in ("prompts without a cache", "mixed prefill/decode step", "decode-only step (sliding window 4)"):
        assert kind in problem


@pytest.mark.usefixtures("log")  # (caplog sees vllmini's INFO records)
def test_auto_skips_flash_attention_backends_for_sinks(monkeypatch, caplog):
    """CPU: the cpu backend, as for any model. CUDA: never flash-attn nor torch's varlen FlashAttention
    (neither has sinks, even where each caps scores), logged once naming both; the Triton kernel, else torch."""
    assert select_backend(None, CPU, torch.float32, 16, sinks=True) == "cpu"
    assert select_backend(None, CPU, torch.float16, 16, sinks=True) == "torch"
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_module(softcap=True))
    monkeypatch.setattr(backend_select, "torch_varlen_backend", lambda: torch_varlen_backend(capped_varlen_attn))
    assert select_backend(None, CUDA, torch.bfloat16, 256) == "flash_attn"  # (no sinks: as before)
    for triton, fallback in ((True, "triton"), (False, "torch")):
        set_triton(monkeypatch, present=triton)
        caplog.clear()
        assert select_backend(None, CUDA, torch.bfloat16, 256, sinks=True) == fallback
        skipped = [r.getMessage() for r in caplog.records if "attention sinks" in r.getMessage()]
        assert len(skipped) == 1 and "flash_attn_varlen_func takes no attention sinks" in skipped[0]
        assert "varlen_attn takes no attention sinks" in skipped[0]


@pytest.mark.parametrize(("requested", "device", "dtype", "expected"), [
    ("cpu", CPU, torch.bfloat16, "cpu"), ("torch", CPU, torch.float16, "torch"),
    ("triton", CUDA, torch.bfloat16, "triton"), ("torch", CUDA, torch.bfloat16, "torch"),
    ("flash_attn", CUDA, torch.bfloat16, "flash-attn 2's flash_attn_varlen_func takes no attention sinks"),
    ("torch_varlen", CUDA, torch.bfloat16, r"torch .*'s varlen_attn takes no attention sinks"),
])  # fmt: skip
def test_a_forced_backend_without_sinks_is_refused_by_name(monkeypatch, requested, device, dtype, expected):
    """The backends with sinks are taken when forced; flash-attn and torch's varlen FlashAttention (installed,
    each able to cap scores) are refused naming the backend and the sinks, and taken for a model without."""
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_module(softcap=True))
    monkeypatch.setattr(backend_select, "torch_varlen_backend", lambda: torch_varlen_backend(capped_varlen_attn))
    set_triton(monkeypatch, present=True)
    assert select_backend(requested, device, dtype, 256) == requested
    if expected in backend_select.BACKEND_NAMES:
        assert select_backend(requested, device, dtype, 256, sinks=True) == expected
        return
    why = rf"the model has attention sinks \(a learned softmax logit per head, gpt-oss\) and {expected}"
    with pytest.raises(ValueError, match=rf"attention_backend='{requested}' cannot be used: {why}"):
        select_backend(requested, device, dtype, 256, sinks=True)


def test_engine_hands_the_model_and_drafts_sinks_to_backend_selection(tiny_dir, monkeypatch):
    """engine_setup passes ``attention_sinks`` of the model and of its draft model to the start-up check
    (here every model claims sinks): a forced flash_attn is refused naming the sinks, and with the cpu
    backend both start-up checks ran with sinks."""
    from vllmini import LLM
    from vllmini.engine import engine_setup
    from vllmini.models.llama import LlamaForCausalLM

    monkeypatch.setattr(LlamaForCausalLM, "attention_sinks", property(lambda self: True))
    with pytest.raises(ValueError, match=r"attention_backend='flash_attn' cannot be used: the model has attention"):
        LLM(model=str(tiny_dir), attention_backend="flash_attn", kv_cache_memory=2**22)
    calls, real = [], engine_setup.start_backend

    def recorded(*args):
        calls.append(args[-1])  # (sinks: the last argument)
        return real(*args)

    monkeypatch.setattr(engine_setup, "start_backend", recorded)
    llm = LLM(model=str(tiny_dir), kv_cache_memory=2**22, max_model_len=64,
              speculative_config={"model": str(tiny_dir), "num_speculative_tokens": 2})  # fmt: skip
    assert calls == [True, True] and llm.llm_engine.attention_backend == "cpu"


@pytest.fixture(scope="module")
def sink_model(tmp_path_factory, default_model_dir):
    """A tiny Mistral (GQA, a sliding window of 8 in every layer) with a sink logit per head in every layer,
    saved with them under gpt-oss's name (``model.layers.i.self_attn.sinks``), and transformers' model
    attending with gpt-oss's ``eager_attention_forward`` (its mask function registered too: a sliding
    window needs one)."""
    from transformers import AttentionInterface, MistralForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from helpers import save_tiny_model, tiny_mistral_config

    AttentionInterface.register("vllmini_test_sinks", eager_attention_forward)
    AttentionMaskInterface.register("vllmini_test_sinks", eager_mask)
    torch.manual_seed(0)
    hf = MistralForCausalLM(tiny_mistral_config(vocab_size=49152, sliding_window=8)).eval()
    for layer in hf.model.layers:
        layer.self_attn.sinks = torch.nn.Parameter(torch.randn(hf.config.num_attention_heads) + 1)
    hf.set_attn_implementation("vllmini_test_sinks")
    return str(save_tiny_model(hf, tmp_path_factory.mktemp("sinks"), default_model_dir)), hf


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_engine_with_sinks_matches_transformers(sink_model, monkeypatch, backend):
    """The decoder's ``attn_sinks`` variant loads the checkpoint's sinks and hands them to the backend: greedy
    tokens and logprobs equal transformers' (gpt-oss's eager math) over prompts prefilled in 16-token chunks
    past the window (each chunk reads the window behind it from the cache, blocks behind it released), one
    sharing another's prefix, then the same prompts from the prefix cache."""
    import dataclasses

    from test_gemma import assert_cached_runs_match_transformers
    from vllmini import LLM
    from vllmini.models.llama import MistralForCausalLM

    monkeypatch.setattr(MistralForCausalLM, "variant", dataclasses.replace(MistralForCausalLM.variant, attn_sinks=True))
    model_dir, hf = sink_model
    llm = LLM(model=model_dir, attention_backend=backend, max_num_batched_tokens=16, enable_prefix_caching=True,
              kv_cache_memory=2**22)  # fmt: skip
    engine = llm.llm_engine
    assert engine.attention_backend == backend and engine.model.attention_sinks and engine.model.kv_window == 8
    assert_cached_runs_match_transformers(llm, hf, f"sinks on {backend}")


def test_prefill_benchmark_runs():
    """bench/attention_sinks.py (the prefill figures in eager_attention.sink_prefill's docstring), tiny."""
    from bench.attention_sinks import main

    (row,) = main(["--tokens", "24", "--dtypes", "float32", "--repeats", "1"])
    assert row["sdpa_no_sinks_ms"] > 0 and row["sdpa_sink_key_err"] < 1e-5 and row["eager_tiles_err"] < 1e-5
