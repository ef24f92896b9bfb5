"""``kv_cache_dtype`` (vLLM's fp8 / fp8_e4m3 / fp8_e5m2 / bfloat16 KV caches).

The oracle is transformers with its attention's keys and values rounded to the cache's format
(an attention function registered with transformers' ``AttentionInterface``: the rounding, then
its own SDPA attention): the engine must give its greedy tokens and logprobs, which only holds
if every key and value the engine attends to, the step's own included, went through the same
rounding. The plain model is further away, so the rounding really happens."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import NEAR_TIE, register_rounded_kv_attention, save_tiny_model, tiny_llama_config, tiny_qwen3_config
from test_attention import BS, D, MIXES, build_batch
from test_engine import assert_no_leaks
from vllmini import LLM, EngineArgs, SamplingParams
from vllmini.kv.cache_dtype import KV_CACHE_DTYPES, resolve_kv_cache_dtype, round_to_cache, to_cache
from vllmini.models.attention import torch_attention
from vllmini.models.cpu_attention import cpu_attention

FORMATS = ["fp8_e4m3", "fp8_e5m2", "bfloat16"]
PROMPTS = [[5, 17, 300, 42, 9, 1200, 77, 3] * 3, [901, 44, 3, 3, 12], list(range(200, 251))]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory, default_model_dir):
    make = {"llama": tiny_llama_config, "qwen3": tiny_qwen3_config}[request.param]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(make(vocab_size=49152, initializer_range=0.05)).eval()
    return str(save_tiny_model(hf, tmp_path_factory.mktemp("kvdtype"), default_model_dir))


def _errors(llm: LLM, hf, max_tokens: int = 12) -> tuple[float, list[str]]:
    """The largest |logprob - transformers'| over every reported (top-5) token of a greedy run,
    teacher-forced on the engine's tokens, and where the engine's greedy token is not transformers'
    top one (outside near ties)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    worst, wrong = 0.0, []
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        done = out.outputs[0]
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + done.token_ids])).logits[0].float()
        for k, (token, top) in enumerate(zip(done.token_ids, done.logprobs)):
            row = logits[len(prompt) + k - 1]
            best2 = row.topk(2).values
            if token != int(row.argmax()) and float(best2[0] - best2[1]) >= NEAR_TIE:
                wrong.append(f"prompt {i} step {k}")
            ref = row.log_softmax(-1)
            worst = max([worst] + [abs(lp - ref[t].item()) for t, lp in top.items()])
    return worst, wrong


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("name", FORMATS)
def test_engine_equals_transformers_with_rounded_kv(tiny, name, backend):
    """Chunked prefill (16-token steps), so most attention reads earlier chunks back from the cache;
    a second run of the same prompts reads their prefixes from the prefix cache."""
    llm = LLM(model=tiny, kv_cache_dtype=name, attention_backend=backend, max_num_batched_tokens=16,
              kv_cache_memory=1 << 22)  # fmt: skip
    caches = {c.dtype for layer in llm.llm_engine.runner.kv_caches for c in layer}
    assert caches == {KV_CACHE_DTYPES[name]}
    rounded = AutoModelForCausalLM.from_pretrained(tiny, attn_implementation=register_rounded_kv_attention(name)).eval()
    for run in ("first", "prefix-cached"):
        worst, wrong = _errors(llm, rounded)
        assert not wrong, f"{run} run: greedy tokens differ from transformers' at {wrong}"
        assert worst < 2e-4, f"{run} run: logprobs {worst:.2e} from transformers' with rounded K/V"
    assert llm.llm_engine.block_manager.prefix_cache_hits > 0
    assert_no_leaks(llm)
    plain = AutoModelForCausalLM.from_pretrained(tiny).eval()
    assert _errors(llm, plain)[0] > 1e-3, "the cache's rounding has no visible effect: is it stored rounded?"


def test_preempted_requests_recompute_the_same_logprobs(tiny):
    """A cache too small for every request at once: preempted sequences recompute their K/V and
    round them again, to the same values."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": [7 + i, 300, 42, 9] * 4} for i in range(6)]
    roomy = LLM(model=tiny, kv_cache_dtype="fp8", kv_cache_memory=1 << 22)
    want = [o.outputs[0] for o in roomy.generate(prompts, params, use_tqdm=False)]
    del roomy
    blocks_for_two = 2 * -(-(16 + 24) // 4)
    tight = LLM(model=tiny, kv_cache_dtype="fp8", block_size=4,
                kv_cache_memory=blocks_for_two * _bytes_per_block(tiny, 4))  # fmt: skip
    got = [o.outputs[0] for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.llm_engine.scheduler.stats.num_preemptions > 0
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-5 for t in x)
    assert_no_leaks(tight)


def _bytes_per_block(model_dir: str, block_size: int) -> int:
    """One block of an fp8 cache: 2 (K, V) x layers x block_size x KV heads x head_dim bytes."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * head_dim


def test_a_narrower_cache_holds_more_tokens(tiny_dir):
    from vllmini.metrics.stat_logger import cache_config_info

    engines = {name: LLM(model=str(tiny_dir), kv_cache_dtype=name, kv_cache_memory=1 << 22).llm_engine
               for name in ("auto", "bfloat16", "fp8", "fp8_e5m2")}  # fmt: skip
    blocks = {name: engine.num_blocks for name, engine in engines.items()}
    assert cache_config_info(engines["fp8"])["cache_dtype"] == "fp8"  # (vllm:cache_config_info's label)
    assert blocks["bfloat16"] // 2 == blocks["auto"]  # (each count is the budget // one block's bytes)
    assert blocks["fp8"] == blocks["fp8_e5m2"] and blocks["fp8"] // 4 == blocks["auto"]


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_cpu_kernel_reads_fp8_caches_as_the_torch_backend(name, mix):
    """The C decode kernel widens fp8 bytes itself (bit moves and a rebias, subnormals included);
    the torch backend gathers and casts with torch. Both see the same values."""
    cache_dtype = KV_CACHE_DTYPES[name]
    q, k, v, (kc, vc), meta, _, _ = build_batch(*MIXES[mix], seed=3)
    kc[0, 0, 0, :4] = torch.tensor([1e-3, -2e-4, 3e-5, 0.0])  # fp8 subnormals (e4m3's start below 2^-6)
    k, v = round_to_cache(k, cache_dtype), round_to_cache(v, cache_dtype)
    caches = [(to_cache(kc, cache_dtype), to_cache(vc, cache_dtype)) for _ in range(2)]
    got = cpu_attention(q, k, v, meta, caches[0], D**-0.5)
    meta.backend_plan = None  # (plans are per backend)
    want = torch_attention(q, k, v, meta, caches[1], D**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(caches[0][0].view(torch.uint8), caches[1][0].view(torch.uint8))  # the same bytes written
    assert BS == caches[0][0].shape[1]


@pytest.mark.parametrize("backend", [torch_attention, cpu_attention])
def test_the_new_kv_is_cast_to_fp8_once_per_layer(backend):
    """``Attention.forward`` casts the step's K and V to the cache's format once each, and the
    backend stores those bytes: rounding them there and back, then casting again to store them
    (its first form) took two casts per tensor, about 5% of an fp8 engine's op time."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from vllmini.models.attention import Attention

    class FP8Casts(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            cast = func.overloadpacket in (torch.ops.aten.to, torch.ops.aten._to_copy)
            if cast and out.dtype == torch.float8_e4m3fn and out.data_ptr() != args[0].data_ptr():  # (a no-op .to)
                FP8Casts.count += 1
            return out

    q, k, v, (kc, vc), meta, _, _ = build_batch(*MIXES["mixed"], seed=3)
    attn = Attention(q.shape[1], k.shape[1], D, D**-0.5)
    attn.backend = backend
    cache = (to_cache(kc, torch.float8_e4m3fn), to_cache(vc, torch.float8_e4m3fn))
    with torch.inference_mode(), FP8Casts():
        attn(q, k, v, meta, cache)
    assert FP8Casts.count == 2


def test_fp8_stores_saturate_instead_of_overflowing():
    x = torch.tensor([1e5, -1e6, 3.0, float("nan")])
    assert to_cache(x, torch.float8_e4m3fn).float()[:3].tolist() == [448.0, -448.0, 3.0]
    assert to_cache(x, torch.float8_e5m2).float()[:3].tolist() == [57344.0, -57344.0, 3.0]
    assert to_cache(x, torch.float8_e5m2).float()[3].isnan()  # (NaN stays NaN, as in the model's dtype)


def test_names_and_refusals():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.float32) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    assert resolve_kv_cache_dtype("bfloat16", torch.float32) == torch.bfloat16
    with pytest.raises(ValueError, match=r"kv_cache_dtype='bfloat16' does not fit a torch.float16 model"):
        resolve_kv_cache_dtype("bfloat16", torch.float16)
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_inc' is not supported \(vLLM's fp8_inc"):
        EngineArgs(kv_cache_dtype="fp8_inc").validate()
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8' is not supported; accepted: \['auto'"):
        EngineArgs(kv_cache_dtype="int8").validate()
    with pytest.raises(ValueError, match=r"calculate_kv_scales=True is not supported"):
        EngineArgs(calculate_kv_scales=True).validate()


def test_fused_cuda_backends_refuse_an_fp8_cache(monkeypatch):
    """flash-attn 2 and torch's varlen kernel read K/V in q's dtype: forced, an fp8 cache is
    refused naming the constraint; auto skips them (here: for the Triton kernel, or for a float32
    model the torch backend)."""
    from vllmini.models import backend_select

    cuda = torch.device("cuda")
    monkeypatch.setattr(backend_select, "_flash_attn_importable", lambda: True)
    monkeypatch.setattr(backend_select, "_triton_importable", lambda: True)
    assert backend_select.select_backend(None, cuda, torch.bfloat16, 256) == "flash_attn"
    assert backend_select.select_backend(None, cuda, torch.bfloat16, 256, torch.float8_e4m3fn) == "triton"
    # a float32 model's Triton tiles spill registers widening fp8 (bench/triton_compile_check.py): torch's
    assert backend_select.select_backend(None, cuda, torch.float32, 256, torch.float8_e4m3fn) == "torch"
    with pytest.raises(ValueError, match=r"attention_backend='flash_attn' cannot be used: .*reads the KV cache in the "
                                         r"model's dtype only \(the cache holds torch.float8_e4m3fn"):  # fmt: skip
        backend_select.select_backend("flash_attn", cuda, torch.bfloat16, 256, torch.float8_e4m3fn)


def test_the_command_line_takes_it(capsys, caplog, monkeypatch, tiny_dir):
    import logging

    from vllmini.cli import main

    assert main(["generate", "--kv-cache-dtype", "fp8_inc", "hi"]) == 2
    assert "kv_cache_dtype='fp8_inc' is not supported" in capsys.readouterr().err
    monkeypatch.setattr(logging.getLogger("vllmini"), "propagate", True)  # (vllmini's logger has its own handler)
    with caplog.at_level(logging.INFO, logger="vllmini"):
        assert main(["generate", "--model", str(tiny_dir), "--kv-cache-dtype", "fp8", "--max-tokens", "4", "hi"]) == 0
    assert "KV cache torch.float8_e4m3fn" in caplog.text


def test_speculative_decoding_over_fp8_caches_changes_no_output(tiny):
    """The model as its own draft, both caches fp8: the target verifies each row's drafts as one
    multi-token chunk over its fp8 cache, the draft decodes them one at a time over its own; with
    the same rounding everywhere the draft's tokens are the target's (nearly all accepted) and the
    output is plain fp8 decoding's."""
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = LLM(model=tiny, kv_cache_dtype="fp8", kv_cache_memory=1 << 22)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    del plain
    spec = LLM(model=tiny, kv_cache_dtype="fp8", kv_cache_memory=1 << 22,
               speculative_config={"model": tiny, "num_speculative_tokens": 3})  # fmt: skip
    assert {c.dtype for layer in spec.llm_engine.runner.draft_kv_caches for c in layer} == {torch.float8_e4m3fn}
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == want
    stats = spec.llm_engine.spec_stats
    assert stats.num_draft_tokens > 20 and stats.acceptance_rate > 0.9, stats
    assert_no_leaks(spec)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_n_greater_than_one_forks_fp8_blocks(tiny, name):
    """n > 1: the siblings copy their first sequence's partially filled prompt block (fork), which
    torch cannot index-copy as fp8: each sibling (top_k=1, greedy n > 1 being refused) is the n=1 output."""
    llm = LLM(model=tiny, kv_cache_dtype=name, kv_cache_memory=1 << 22)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]  # none a whole number of blocks long
    one = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    two = llm.generate(prompts, SamplingParams(max_tokens=8, top_k=1, ignore_eos=True, n=2), use_tqdm=False)
    for a, b in zip(one, two):
        assert [c.token_ids for c in b.outputs] == [a.outputs[0].token_ids] * 2
    assert_no_leaks(llm)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_cpu_kernel_widens_every_fp8_byte(cache_dtype):
    """Every finite byte value, as a value (one key: the output is its value row, exactly) and
    as a key (row b attends over [its key, a zero key] with the query on that dimension: the
    weight of value 1 is sigmoid(key x scale))."""
    from vllmini.models.cpu_attention import paged_decode

    finite = torch.arange(256, dtype=torch.uint8)
    finite = finite[torch.isfinite(finite.view(cache_dtype).float())]
    n = len(finite)  # (e4m3: 254, without its two NaNs; e5m2: 248, without NaNs and infinities)
    values = torch.zeros(1, 16, 1, n, dtype=torch.uint8)
    values[0, 0, 0] = finite
    v = values.view(cache_dtype)
    out = paged_decode(torch.zeros(1, 1, 1, n), torch.zeros_like(v), v, torch.zeros(1, 1, dtype=torch.int32),
                       torch.ones(1, dtype=torch.int32), 1.0)  # fmt: skip
    assert torch.equal(out[0, 0, 0], finite.view(cache_dtype).float())
    keys = torch.zeros(n, 16, 1, 16, dtype=torch.uint8)  # block b: row b's two keys
    keys[:, 0, 0, 0] = finite
    vals = torch.zeros(n, 16, 1, 16)
    vals[:, 0, 0, :] = 1.0
    q = torch.zeros(n, 1, 1, 16)
    q[:, 0, 0, 0] = 1.0
    scale = 1e-3 if cache_dtype == torch.float8_e5m2 else 1e-2  # (keeps sigmoid's slope away from 0)
    got = paged_decode(q, keys.view(cache_dtype), vals.to(cache_dtype), torch.arange(n, dtype=torch.int32)[:, None],
                       torch.full((n,), 2, dtype=torch.int32), scale)[:, 0, 0, 0]  # fmt: skip
    want = torch.sigmoid(finite.view(cache_dtype).float() * scale)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
