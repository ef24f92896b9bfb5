"""Engine features the CPU suite holds to transformers, rerun on CUDA against the CPU path
(float32, where a tiny random model's greedy tokens do not depend on the device): n-gram and
draft-model speculative decoding, a custom logits processor, logprobs with logprob_token_ids,
the logprobs modes, preemption and prefix-cache hits under a small KV budget, the async engine's concurrent
streams, embeddings from the pooling runner, a thinking token budget, prompts given as embeddings,
a YaRN-scaled rope, fp8 KV caches, the hybrid (grouped) KV cache of a Gemma 3 and of gpt-oss (attention sinks),
DeepSeek-V3's latent attention (MLA), GLM-4.5's grouped router and Qwen3.5's linear attention. bench/gpu_check.sh runs them; without CUDA
they skip. ``VLLMINI_FEATURES_DEVICE=cpu`` runs them CPU against CPU, which checks the tests
themselves on a machine without a GPU."""
from __future__ import annotations

import asyncio
import os
from typing import Any, Callable

import pytest
import torch

from bench.random_model import save_word_level_tokenizer
from helpers import tiny_llama_config
from vllmini import LLM, SamplingParams
from vllmini.engine.logits_processor import BatchUpdate, LogitsProcessor, process_dict_updates

DEVICE = os.environ.get("VLLMINI_FEATURES_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")
KV_BYTES = 1 << 28
VOCAB = 512


def _save_tiny_llama(out, attention_scale: float = 1.0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_llama_config(max_position_embeddings=2048), dtype=torch.float32)
    assert hf.config.vocab_size == VOCAB
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.mul_(attention_scale)
    hf.save_pretrained(out)
    save_word_level_tokenizer(VOCAB, out)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _save_tiny_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def looping_dir(tmp_path_factory):
    """Attention damped to a hundredth: the next token depends mostly on the last one, so the
    outputs fall into loops that n-gram drafts predict (attention still moves the logits)."""
    return _save_tiny_llama(tmp_path_factory.mktemp("looping"), attention_scale=0.01)


def on_both(model_dir, run: Callable[[LLM], Any], **engine_args) -> tuple[Any, Any]:
    """``run`` on a CPU engine, then on a DEVICE engine with the same arguments (float32); each
    engine is dropped before the next starts."""
    results = []
    for device in ("cpu", DEVICE):
        args = dict(max_model_len=1024, max_num_seqs=8, kv_cache_memory=KV_BYTES)
        llm = LLM(model=str(model_dir), device=device, dtype="float32", **{**args, **engine_args})
        results.append(run(llm))
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results[0], results[1]


def prompts(n: int, seed: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(0, VOCAB, (1 + 37 * i,), generator=g).tolist()} for i in range(n)]


def greedy(max_tokens: int = 24, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **extra)


def token_ids(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def test_ngram_speculation_matches_the_cpu_path_and_plain_decoding(looping_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    ps = prompts(6)

    def run(llm: LLM):
        return token_ids(llm.generate(ps, greedy(40), use_tqdm=False)), llm.llm_engine.spec_stats.num_accepted_tokens

    (cpu, cpu_accepted), (dev, dev_accepted) = on_both(looping_dir, run, speculative_config=spec)
    plain, _ = on_both(looping_dir, lambda llm: token_ids(llm.generate(ps, greedy(40), use_tqdm=False)))
    assert dev == cpu == plain
    assert dev_accepted == cpu_accepted > 10


def test_draft_model_speculation_matches_plain_decoding(model_dir):
    """The target as its own draft: the draft's KV cache on the device's blocks holds the right
    K/V (else its drafts would be refused), and the outputs are plain decoding's."""
    ps = prompts(5)

    def run(llm: LLM):
        stats = llm.llm_engine.spec_stats
        return token_ids(llm.generate(ps, greedy(30), use_tqdm=False)), stats.num_draft_tokens, stats.num_accepted_tokens

    spec = {"model": str(model_dir), "num_speculative_tokens": 3}
    (cpu, _, _), (dev, drafted, accepted) = on_both(model_dir, run, speculative_config=spec)
    plain, _ = on_both(model_dir, lambda llm: token_ids(llm.generate(ps, greedy(30), use_tqdm=False)))
    assert dev == cpu == plain
    assert drafted > 50 and accepted > 0.9 * drafted


class TargetToken(LogitsProcessor):
    """``extra_args={"target_token": t}``: the request samples only t (its rows indexed on the
    logits' own device)."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.targets: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.targets, batch_update, lambda params, *_: (params.extra_args or {}).get("target_token"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.targets:
            rows = torch.tensor(list(self.targets), device=logits.device)
            cols = torch.tensor(list(self.targets.values()), device=logits.device)
            keep = logits[rows, cols].clone()
            logits[rows] = float("-inf")
            logits[rows, cols] = keep
        return logits


def test_custom_logits_processor_on_the_device(model_dir):
    ps = prompts(8)
    params = [greedy(12, extra_args={"target_token": 10 + i}) if i % 2 else greedy(12) for i in range(8)]
    cpu, dev = on_both(model_dir, lambda llm: token_ids(llm.generate(ps, params, use_tqdm=False)),
                       logits_processors=[TargetToken], max_num_batched_tokens=64)  # fmt: skip
    assert dev == cpu
    assert all(dev[i] == [10 + i] * 12 for i in range(1, 8, 2))


def test_logprobs_and_logprob_token_ids_match_the_cpu_path(model_dir):
    ps = prompts(4)
    params = [greedy(10, logprobs=3), greedy(10, logprob_token_ids=[5, 7, 400]), greedy(10, logprobs=0), greedy(10)]

    def run(llm: LLM):
        outs = llm.generate(ps, params, use_tqdm=False)
        return token_ids(outs), [[{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in o.outputs[0].logprobs or []]
                                 for o in outs]  # fmt: skip

    (cpu_tokens, cpu_lps), (dev_tokens, dev_lps) = on_both(model_dir, run)
    assert dev_tokens == cpu_tokens
    for cpu_req, dev_req in zip(cpu_lps, dev_lps):
        assert [d.keys() for d in dev_req] == [d.keys() for d in cpu_req]
        for c, d in zip(cpu_req, dev_req):
            assert all(abs(c[t][0] - d[t][0]) < 1e-3 and c[t][1] == d[t][1] for t in c)
    assert {5, 7, 400} <= set(dev_lps[1][0]) and len(dev_lps[0][0]) >= 3 and dev_lps[3] == []


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logits", "processed_logprobs"])
def test_logprobs_modes_match_the_cpu_path(model_dir, mode):
    """EngineArgs.logprobs_mode on the device: the raw logits, and the penalized logits (or their
    logprobs) of greedy rows with a repetition penalty, as the CPU path reports them."""
    ps = prompts(3)
    params = [greedy(8, logprobs=4, repetition_penalty=r) for r in (1.0, 1.3, 0.8)]

    def run(llm: LLM):
        outs = llm.generate(ps, params, use_tqdm=False)
        return token_ids(outs), [[{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs] for o in outs]

    (cpu_tokens, cpu_lps), (dev_tokens, dev_lps) = on_both(model_dir, run, logprobs_mode=mode)
    assert dev_tokens == cpu_tokens
    for cpu_req, dev_req in zip(cpu_lps, dev_lps):
        for c, d in zip(cpu_req, dev_req):
            assert c.keys() == d.keys() and all(abs(c[t] - d[t]) < 1e-3 for t in c)


def test_preemption_and_prefix_cache_hits_match_the_cpu_path(model_dir):
    """12 blocks of 16 tokens for 8 requests that share a prefix: requests are preempted and
    recomputed, later ones hit the cached prefix, and every block is free at the end."""
    shared = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    ps = [{"prompt_token_ids": shared + [i + 2] * (1 + i)} for i in range(8)]

    def run(llm: LLM):
        outs = llm.generate(ps, greedy(40), use_tqdm=False)
        eng = llm.llm_engine
        bm = eng.block_manager
        bm.check_invariants()
        assert not eng.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
        return token_ids(outs), eng.scheduler.stats.num_preemptions, sum(o.metrics.num_cached_tokens for o in outs)

    from transformers import AutoConfig

    from test_engine import kv_bytes

    budget = kv_bytes(AutoConfig.from_pretrained(model_dir), 12, block_size=16)
    (cpu, _, _), (dev, preemptions, cached) = on_both(model_dir, run, block_size=16, kv_cache_memory=budget,
                                                      max_model_len=192, max_num_batched_tokens=64)  # fmt: skip
    assert dev == cpu
    assert preemptions > 0 and cached > 0


def test_async_engine_streams_match_the_offline_engine(model_dir):
    """Eight concurrent streams through AsyncLLMEngine (steps on its engine thread, decode
    graphs replayed there when the device has them): the tokens of LLM.generate."""
    from vllmini import AsyncLLMEngine, EngineArgs

    ps = prompts(8)
    offline, _ = on_both(model_dir, lambda llm: token_ids(llm.generate(ps, greedy(20), use_tqdm=False)))

    async def stream_all() -> list[list[int]]:
        args = EngineArgs(model=str(model_dir), device=DEVICE, dtype="float32", max_model_len=1024, max_num_seqs=8,
                          kv_cache_memory=KV_BYTES)  # fmt: skip
        engine = AsyncLLMEngine.from_engine_args(args)

        async def one(i: int) -> list[int]:
            final = None
            async for out in engine.generate(ps[i], greedy(20), request_id=f"r{i}"):
                final = out
            return list(final.outputs[0].token_ids)

        try:
            return list(await asyncio.gather(*(one(i) for i in range(8))))
        finally:
            await engine.shutdown()

    assert asyncio.run(stream_all()) == offline


def test_embeddings_match_the_cpu_path(model_dir):
    texts = [" ".join(f"t{(7 * i + j) % VOCAB}" for j in range(3 + 20 * i)) for i in range(4)]
    cpu, dev = on_both(model_dir, lambda llm: [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)],
                       runner="pooling")  # fmt: skip
    torch.testing.assert_close(torch.tensor(dev), torch.tensor(cpu), atol=1e-4, rtol=1e-3)
    assert len(dev) == 4 and len(dev[0]) == 64


def test_thinking_token_budget_on_the_device(model_dir):
    """A reasoning section opened by the prompt ("t5"), closed by "t6" once it holds the budget's
    tokens (the forced token written over the sampled one on the device)."""
    ps = [{"prompt_token_ids": p["prompt_token_ids"] + [5]} for p in prompts(4)]
    params = [greedy(10, thinking_token_budget=b) for b in (0, 3, 6, None)]
    config = {"reasoning_start_str": "t5", "reasoning_end_str": "t6"}
    cpu, dev = on_both(model_dir, lambda llm: token_ids(llm.generate(ps, params, use_tqdm=False)), reasoning_config=config)
    assert dev == cpu
    assert [dev[i][b] for i, b in enumerate((0, 3, 6))] == [6, 6, 6]


def test_prompt_embeds_match_the_cpu_path(model_dir):
    """Prompts given as embeddings (the model's own table's rows: the tokens' answers), prefilled
    in chunks on the device (eager: a step holding them never replays a decode graph), then
    decoded: the same tokens as the CPU path and as the token prompts."""
    from safetensors.torch import load_file

    table = load_file(next(model_dir.glob("*.safetensors")))["model.embed_tokens.weight"]
    ps = [p["prompt_token_ids"] for p in prompts(4)]

    def run(llm: LLM):
        by_embeds = llm.generate([{"prompt_embeds": table[p]} for p in ps], greedy(16), use_tqdm=False)
        return token_ids(by_embeds), token_ids(llm.generate([{"prompt_token_ids": p} for p in ps], greedy(16),
                                                             use_tqdm=False))  # fmt: skip

    (cpu, cpu_tokens), (dev, dev_tokens) = on_both(model_dir, run, enable_prompt_embeds=True, max_num_batched_tokens=32)
    assert dev == dev_tokens == cpu == cpu_tokens


def test_yarn_rope_matches_the_cpu_path(tmp_path):
    """A YaRN-scaled model (Qwen3's long-context recipe): its cos/sin carry the attention factor,
    in eager prefill and in captured decode steps alike."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_llama_config(max_position_embeddings=2048, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256})  # fmt: skip
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    save_word_level_tokenizer(VOCAB, tmp_path)
    cpu, dev = on_both(tmp_path, lambda llm: token_ids(llm.generate(prompts(6), greedy(20), use_tqdm=False)))
    assert dev == cpu
    assert LLM(model=str(tmp_path), device=DEVICE, kv_cache_memory=KV_BYTES).llm_engine.max_model_len == 1024


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache_matches_the_cpu_path(model_dir, kv_cache_dtype):
    """An fp8 KV cache: the device's kernel (Triton on a GPU: flash-attn reads no fp8) widens the
    bytes the CPU's C kernel widens, in prefill chunks, eager steps and captured decode graphs."""

    def run(llm: LLM):
        assert {c.dtype for layer in llm.llm_engine.runner.kv_caches for c in layer} == {torch.float8_e4m3fn
                if kv_cache_dtype == "fp8_e4m3" else torch.float8_e5m2}  # fmt: skip
        outs = llm.generate(prompts(6), greedy(20, logprobs=2), use_tqdm=False)
        return token_ids(outs), [[lp[t] for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]

    (cpu, cpu_lps), (dev, dev_lps) = on_both(model_dir, run, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=64)
    assert dev == cpu
    worst = max(abs(a - b) for xs, ys in zip(cpu_lps, dev_lps) for a, b in zip(xs, ys))
    assert worst < 1e-3, f"logprobs {worst:.2e} from the CPU path's"


def test_bfloat16_over_an_fp8_cache_matches_transformers(model_dir):
    """bfloat16 (CUDA's default dtype) over an fp8 e4m3 cache, where a GPU runs the Triton kernel
    on fp8 bytes (prefill chunks, eager steps, replayed decode graphs). The oracle is transformers
    with its K/V rounded the same way: the engine's logprobs must sit no further from its float32
    model's than its own bfloat16 model's do (as tests/test_cpu_bfloat16.py holds bf16 to float32;
    fp8 rounding amplifies bf16's differences, so the bounds are 1.5x mean and 2x max)."""
    from transformers import AutoModelForCausalLM

    from helpers import register_rounded_kv_attention

    llm = LLM(model=str(model_dir), device=DEVICE, dtype="bfloat16", kv_cache_dtype="fp8", max_model_len=1024,
              max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory=KV_BYTES)  # fmt: skip
    if DEVICE == "cuda":
        assert llm.llm_engine.attention_backend == "triton"
    ps = [p["prompt_token_ids"] for p in prompts(5)]
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], greedy(16, logprobs=5), use_tqdm=False)
    impl = register_rounded_kv_attention("fp8")
    hf32, hf16 = (AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=impl).to(DEVICE).eval()
                  for dtype in (torch.float32, torch.bfloat16))  # fmt: skip
    ours, theirs = [], []
    for p, out in zip(ps, outs):
        done = out.outputs[0]
        seq = torch.tensor([p + list(done.token_ids)], device=DEVICE)
        with torch.no_grad():
            ref, half = (m(seq).logits[0].float().log_softmax(-1).cpu() for m in (hf32, hf16))
        for k, top in enumerate(done.logprobs):
            pos = len(p) + k - 1
            ours += [abs(lp - ref[pos, t].item()) for t, lp in top.items()]
            theirs += [abs(half[pos, t].item() - ref[pos, t].item()) for t in top]
    ours, theirs = torch.tensor(ours), torch.tensor(theirs)
    assert ours.mean() <= 1.5 * theirs.mean(), f"mean error {ours.mean():.4f} vs transformers bf16's {theirs.mean():.4f}"
    assert ours.max() <= 2 * theirs.max(), f"max error {ours.max():.4f} vs transformers bf16's {theirs.max():.4f}"


def test_hybrid_kv_cache_matches_the_cpu_path(tmp_path):
    """Gemma 3 ([s, s, f, s], a 12-token window) on the grouped KV cache (kv/kv_groups.py): prompts
    several windows long, decode steps replayed from CUDA graphs over every group's block tables,
    the sliding groups releasing what falls behind; greedy tokens equal the CPU path's."""
    from transformers import AutoModelForCausalLM

    from helpers import tiny_gemma3_config

    torch.manual_seed(0)
    config = tiny_gemma3_config(vocab_size=VOCAB, max_position_embeddings=2048)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    save_word_level_tokenizer(VOCAB, tmp_path)

    def run(llm: LLM):
        assert llm.llm_engine.block_manager.num_groups == 4
        outs = token_ids(llm.generate(prompts(6), greedy(40), use_tqdm=False))
        bm = llm.llm_engine.block_manager
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
        return outs

    cpu, dev = on_both(tmp_path, run, block_size=16, max_num_batched_tokens=64)
    assert dev == cpu


def test_gpt_oss_matches_the_cpu_path(tmp_path):
    """gpt-oss (attention sinks in the Triton kernel, prefill and split decode; sliding and full KV
    groups; biased experts with the clamped SwiGLU): greedy tokens equal the CPU path's, where the
    sinks run in the C decode kernel and SDPA with a sink key."""
    from transformers import AutoModelForCausalLM

    from test_gpt_oss import gpt_oss_config, randomize

    torch.manual_seed(0)
    rope = {"rope_type": "yarn", "factor": 8.0, "truncate": False, "original_max_position_embeddings": 128,
            "rope_theta": 150000.0}  # (a 1024-token context, the engines' max_model_len)
    config = gpt_oss_config(vocab_size=VOCAB, max_position_embeddings=1024, rope_parameters=rope)
    randomize(AutoModelForCausalLM.from_config(config, dtype=torch.float32)).save_pretrained(tmp_path)
    save_word_level_tokenizer(VOCAB, tmp_path)

    def run(llm: LLM):
        assert llm.llm_engine.block_manager.num_groups == 2 and llm.llm_engine.model.attention_sinks
        return token_ids(llm.generate(prompts(6), greedy(40), use_tqdm=False))

    cpu, dev = on_both(tmp_path, run, block_size=16, max_num_batched_tokens=64)
    assert dev == cpu


@pytest.mark.parametrize("kind", ["deepseek-v3", "glm4-moe"])
def test_latent_attention_and_grouped_router_models_match_the_cpu_path(tmp_path, kind):
    """DeepSeek-V3 (MLA: one latent KV head, 40 wide here, whose K and V are one cache tensor; the
    noaux_tc router) and GLM-4.5 (rope on half of each head; the same router): greedy tokens
    equal the CPU path's, prefix-cache hits included."""
    from helpers import save_random_model

    if kind == "deepseek-v3":
        from test_deepseek import tiny_config

        config = tiny_config("v3")  # (YaRN: 64 original tokens x4, a 256-token context)
    else:
        from test_glm import tiny_config

        config = tiny_config("moe")
        config.max_position_embeddings = 1024
    assert config.vocab_size == VOCAB
    save_random_model(config, tmp_path, tmp_path)  # (no tokenizer files there: the word-level one follows)
    save_word_level_tokenizer(VOCAB, tmp_path)

    def run(llm: LLM):
        first = token_ids(llm.generate(prompts(6), greedy(32), use_tqdm=False))
        return first, token_ids(llm.generate(prompts(6), greedy(32), use_tqdm=False))  # (the prompts' blocks cached)

    context = 256 if kind == "deepseek-v3" else 1024
    cpu, dev = on_both(tmp_path, run, block_size=16, max_num_batched_tokens=64, enable_prefix_caching=True,
                       max_model_len=context)  # fmt: skip
    assert dev == cpu and cpu[0] == cpu[1]


def test_linear_attention_model_matches_the_cpu_path(tmp_path):
    """Qwen3.5-MoE (Gated DeltaNet layers with per-sequence state slots beside gated full attention):
    greedy tokens of a batch larger than the slots (slots reused), prefilled in chunks beside decode
    rows, equal the CPU path's, with n = 2 siblings forking the prompt's state."""
    from test_qwen3_5 import save_random

    save_random("moe", tmp_path, tmp_path)  # (no tokenizer files there: the word-level one follows)
    save_word_level_tokenizer(VOCAB, tmp_path)

    def run(llm: LLM):
        assert not llm.llm_engine.block_manager.enable_prefix_caching and llm.llm_engine.runner.state_caches
        plain = token_ids(llm.generate(prompts(6), greedy(32), use_tqdm=False))
        forked = llm.generate(prompts(1), SamplingParams(n=2, top_k=1, max_tokens=16, ignore_eos=True), use_tqdm=False)
        return plain, [list(c.token_ids) for c in forked[0].outputs]

    cpu, dev = on_both(tmp_path, run, block_size=16, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=512)
    assert dev == cpu and cpu[1][0] == cpu[1][1] == cpu[0][0][:16]
