"""Qwen3.5 (dense and MoE): Gated DeltaNet linear-attention layers with a per-sequence state beside
gated full-attention layers with a paged KV cache, through the whole engine, equal to transformers
on tiny random checkpoints; the state survives chunked prefill, forking (n > 1), preemption and
aborts, and what it cannot support is refused by name."""
from __future__ import annotations

import asyncio
import copy
import shutil
from pathlib import Path

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from helpers import hf_greedy, assert_greedy_matches, checkpoint_like, prompt_forward, hf_last_logits, random_models, \
    save_tiny_model, seeded_prompts  # fmt: skip
from test_architectures import assert_engine_greedy
from test_engine import assert_no_leaks
from test_fp8_checkpoints import _assert_same_parameters, _block_fp8, _quantize
from test_multimodal_text import _QWEN_TOKENS, _QWEN_VISION, _text
from vllmini import LLM, AsyncLLMEngine, EngineArgs, SamplingParams
from vllmini.models.gated_delta_rule import CHUNK

# 4 layers: three linear-attention layers, then one full-attention layer (full_attention_interval 4)
_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.2,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)  # fmt: skip
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def tiny_config(kind: str):
    if kind == "dense":
        return T.Qwen3_5TextConfig(**_SHAPE, architectures=["Qwen3_5ForCausalLM"])
    if kind == "moe":
        return T.Qwen3_5MoeTextConfig(**_SHAPE, **_MOE, architectures=["Qwen3_5MoeForCausalLM"])
    if kind == "multimodal":  # the releases' form: M-RoPE (interleaved sections) over a partial rotary
        rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 0], "mrope_interleaved": True,
                "partial_rotary_factor": 0.25}  # fmt: skip
        text = _text(T.Qwen3_5TextConfig(**_SHAPE), rope_parameters=rope)
        return T.Qwen3_5Config(text_config=text, vision_config=dict(_QWEN_VISION, num_position_embeddings=16),
                               **_QWEN_TOKENS, architectures=["Qwen3_5ForConditionalGeneration"])  # fmt: skip
    raise KeyError(kind)


def save_random(kind: str, out, tokenizer_dir):
    """Seed 0, every norm, ``dt_bias`` (~1) and ``A_log`` randomised, so none loads unseen; the
    zero-centred norms' weights (offsets from 1) near 0, the linear layers' gated norm near 1."""
    torch.manual_seed(0)
    config = tiny_config(kind)
    auto = T.AutoModelForImageTextToText if kind == "multimodal" else T.AutoModelForCausalLM
    hf = randomize_gated_deltanet(auto.from_config(config).eval())
    return str(save_tiny_model(hf, out, tokenizer_dir)), hf


def randomize_gated_deltanet(hf):
    """Every norm, ``dt_bias`` (~1) and ``A_log`` of a Qwen3.5 / Qwen3-Next model randomised in place."""
    with torch.no_grad():
        for name, tensor in hf.named_parameters():
            if "norm" in name:
                tensor.normal_(1.0 if "linear_attn.norm" in name else 0.0, 0.3)
            elif name.endswith("dt_bias"):
                tensor.normal_(1.0, 0.3)
            elif name.endswith("A_log"):
                tensor.uniform_(-2.0, 1.0)
    return hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    return random_models(None, tmp_path_factory, default_model_dir, save=save_random)


def assert_hybrid_matches(model_dir: str, hf, backend: str, what: str) -> LLM:
    """Last-position logits of a flat batch within 1e-4 of transformers' (in float64); greedy tokens of
    five prompts through four sequence slots (a slot is reused), prefilled in chunks of 16 beside
    decode rows (each chunk continuing the state the one before left), equal to transformers'."""
    prompts = seeded_prompts(1, 9, 37, 20, 3)
    llm = LLM(model=model_dir, max_num_batched_tokens=16, max_num_seqs=4, attention_backend=backend)
    assert type(llm.llm_engine.model).__name__ == hf.config.architectures[0]
    torch.testing.assert_close(prompt_forward(llm.llm_engine.model, prompts), float64_logits(hf, prompts),
                               atol=1e-4, rtol=0)  # fmt: skip
    assert_engine_greedy(llm, hf, prompts, 10, what)
    assert llm.llm_engine.scheduler.stats.num_chunked_prefills > 0
    return llm


def randomize_mamba2(hf, biases: tuple[str, ...] = ("bias",)):
    """Every norm (~1), ``dt_bias``, ``A_log``, ``D`` and the biases ending in ``biases`` (~0) of a model
    with Mamba2 layers randomised in place (transformers starts several at 1 or 0)."""
    with torch.no_grad():
        for name, tensor in [*hf.named_parameters(), *hf.named_buffers()]:
            if "norm" in name:
                tensor.normal_(1.0, 0.3)
            elif name.endswith("dt_bias"):
                tensor.normal_(0.0, 1.0)
            elif name.endswith("A_log"):
                tensor.uniform_(-2.0, 1.0)
            elif name.endswith(".D"):
                tensor.normal_(1.0, 0.5)
            elif name.endswith(biases):
                tensor.normal_(0.0, 0.3)
    return hf


def assert_fields_refused(model_cls, config, cases) -> None:
    """Each (config field, value, message) set on a copy of ``config``: ``model_cls`` refuses it, naming it."""
    for field, value, message in cases:
        bad = copy.deepcopy(config)
        setattr(bad, field, value)
        with pytest.raises(ValueError, match=message):
            model_cls(bad)


def assert_missing_tensor_named(model_dir: str, out: Path, tensor: str) -> None:
    """``model_dir`` without ``tensor``: the loader's error names it as the checkpoint does."""
    out = shutil.copytree(model_dir, out)
    tensors = load_file(out / "model.safetensors")
    del tensors[tensor]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"does not provide these parameters: {tensor}$"):
        LLM(model=str(out))


def assert_forked_siblings_match(model_dir: str, hf) -> None:
    """``n = 3`` with ``top_k=1`` (greedy, which n > 1 may not ask by temperature 0): the siblings,
    forked after the prompt (prefilled once), continue copies of its state to transformers' tokens."""
    llm = LLM(model=model_dir)
    prompt = seeded_prompts(21, seed=3)[0]
    out = _greedy(llm, [prompt], SamplingParams(n=3, max_tokens=12, top_k=1, ignore_eos=True))[0]
    assert llm.llm_engine.scheduler.stats.num_prefill_tokens == len(prompt)
    want, gaps = hf_greedy(hf, prompt, 12)
    for completion in out.outputs:
        assert_greedy_matches(completion.token_ids, want, gaps, f"sibling {completion.index}")
    assert_no_leaks(llm)


def assert_preemption_keeps_tokens(model_dir: str, hf) -> None:
    """Too few KV blocks for four sequences at once: the newest are preempted and recomputed from
    zeros in a free slot, to transformers' tokens."""
    llm = LLM(model=model_dir, block_size=4, num_gpu_blocks_override=14, max_num_seqs=4)
    prompts = seeded_prompts(5, 7, 9, 6, seed=4)
    outs = _greedy(llm, prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert llm.llm_engine.scheduler.stats.num_preemptions > 0
    for p, out in zip(prompts, outs):
        assert_greedy_matches(out.outputs[0].token_ids, *hf_greedy(hf, p, 20), "preempted")
    assert_no_leaks(llm)


def _greedy(llm, prompts, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def float64_logits(hf, prompts: list[list[int]]) -> torch.Tensor:
    """transformers' last-position logits computed in float64 (its float32 chunked rule drifts by up to
    3e-4 on these strongly decaying random states, where ours stays within 4e-5 of float64)."""
    exact = copy.deepcopy(hf)
    if hasattr(exact, "set_experts_implementation"):
        exact.set_experts_implementation("eager")  # (grouped_mm takes no float64)
    return hf_last_logits(exact.double(), prompts).float()


@pytest.mark.parametrize(("kind", "backend"), [("dense", "cpu"), ("moe", "torch")])
def test_greedy_and_logits_match_transformers(tiny, kind, backend):
    """Last-position logits of a flat batch within 1e-4 of transformers' (in float64); greedy tokens of
    five prompts through four sequence slots (a slot is reused), prefilled in chunks of 16 beside
    decode rows (each chunk continuing the state the one before left), equal to transformers'."""
    assert_hybrid_matches(*tiny(kind), backend, kind)


def test_only_full_attention_layers_page_their_kv(tiny):
    """One KV cache tensor pair (the full-attention layer), a state pair per linear layer and slot."""
    model_dir, _ = tiny("dense")
    llm = LLM(model=model_dir, max_num_seqs=3)
    runner = llm.llm_engine.runner
    assert len(runner.kv_caches) == 1
    conv = 2 * 2 * 8 + 4 * 8
    assert [(tuple(c.shape), tuple(r.shape), r.dtype) for c, r in runner.state_caches] == \
        [((3, conv, 3), (3, 4, 8, 8), torch.float32)] * 3  # fmt: skip
    assert not llm.llm_engine.block_manager.enable_prefix_caching


def test_prompts_longer_than_a_chunk_of_the_rule(tiny):
    """A prompt over several of the rule's 64-token chunks, prefilled whole and in 48-token steps."""
    model_dir, hf = tiny("dense")
    prompts = seeded_prompts(2 * CHUNK + 7, CHUNK, seed=9)
    torch.testing.assert_close(prompt_forward(LLM(model=model_dir).llm_engine.model, prompts),
                               float64_logits(hf, prompts), atol=1e-4, rtol=0)  # fmt: skip
    assert_engine_greedy(LLM(model=model_dir, max_num_batched_tokens=48), hf, prompts, 8, "long prompts")


def test_n_siblings_fork_the_prompt_state(tiny):
    """``n = 3`` with ``top_k=1`` (greedy, which n > 1 may not ask by temperature 0): the siblings forked
    after the prompt (not prefilled again) continue a copy of its state, so all three give
    transformers' tokens."""
    assert_forked_siblings_match(*tiny("dense"))


def test_async_scheduling_continuations_carry_the_state(tiny):
    """Async scheduling launches each decode continuation before the host sees the tokens (its batch
    built apart from the scheduler's): it must hand the linear layers their sequences' slots too."""
    model_dir, hf = tiny("dense")
    llm = LLM(model=model_dir, async_scheduling=True, max_num_batched_tokens=16)
    assert_engine_greedy(llm, hf, seeded_prompts(5, 17, 30, seed=2), 10, "async scheduling")


def test_sleep_frees_the_states_and_wake_up_gives_the_same_tokens(tiny):
    """Sleep (level 1) frees the state tensors with the KV cache; after wake_up they are back, zeroed,
    and the same prompts give the same tokens."""
    model_dir, hf = tiny("dense")
    llm = LLM(model=model_dir, enable_sleep_mode=True, max_num_seqs=3)
    prompts = seeded_prompts(5, 17, 30, seed=2)
    before = [o.outputs[0].token_ids for o in _greedy(llm, prompts)]
    llm.sleep(level=1)
    assert llm.llm_engine.runner.state_caches == []
    llm.wake_up()
    states = llm.llm_engine.runner.state_caches
    assert len(states) == 3 and all(not t.any() for layer in states for t in layer)
    assert [o.outputs[0].token_ids for o in _greedy(llm, prompts)] == before


def test_preempted_sequences_recompute_their_state(tiny):
    """Too few KV blocks for four sequences at once: the newest are preempted and later recomputed
    from zeros in a free slot, to transformers' tokens."""
    assert_preemption_keeps_tokens(*tiny("moe"))


def test_async_streams_keep_their_states_when_one_is_aborted(tiny):
    """Four concurrent streams in two slots; one is aborted after two tokens: the others stream
    transformers' tokens, and every slot and block is free at the end."""
    model_dir, hf = tiny("dense")
    prompts = seeded_prompts(6, 15, 4, 11, seed=7)

    async def run():
        engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=model_dir, max_num_seqs=2))

        async def consume(i):
            tokens = []
            async for out in engine.generate({"prompt_token_ids": prompts[i]}, GREEDY, request_id=f"r{i}"):
                tokens = out.outputs[0].token_ids
                if i == 1 and len(tokens) >= 2:
                    await engine.abort("r1")
                    break
            return list(tokens)

        results = await asyncio.gather(*(consume(i) for i in range(4)))
        await asyncio.sleep(0.2)
        assert engine.engine.block_manager.num_free_slots == 2
        engine.shutdown()
        return results

    results = asyncio.run(run())
    for i in (0, 2, 3):
        assert_greedy_matches(results[i], *hf_greedy(hf, prompts[i], 12), f"stream {i}")


def test_multimodal_release_serves_its_language_model(tiny, tmp_path):
    """``Qwen3_5ForConditionalGeneration`` (the releases' architecture: M-RoPE over a quarter of
    each head, ``model.language_model.*`` names, a vision tower never read) with a
    multi-token-prediction layer (``mtp.*``, skipped as transformers skips it) equals transformers'
    model on text."""
    model_dir, hf = tiny("multimodal")
    out = shutil.copytree(model_dir, tmp_path / "mtp")
    tensors = load_file(out / "model.safetensors")
    tensors.update({"mtp.fc.weight": torch.zeros(64, 128), "mtp.layers.0.input_layernorm.weight": torch.ones(64)})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(model=str(out), max_num_batched_tokens=16, max_num_seqs=4)
    assert type(llm.llm_engine.model).__name__ == "Qwen3_5ForCausalLM"
    assert_engine_greedy(llm, hf, seeded_prompts(1, 9, 37, 20, 3), 8, "multimodal")


def test_state_dtypes_follow_vllms_mamba_cache_settings(tiny):
    """vLLM's ``mamba_ssm_cache_dtype`` / ``mamba_cache_dtype``: bfloat16 keeps the rule's state and the
    convolution's window in half the bytes (12 slots where float32 gives 6 in the same 64 KiB), the
    tokens stay transformers' (near-tie rule); a dtype outside the choices is refused by name."""
    model_dir, hf = tiny("dense")
    llm = LLM(model=model_dir, max_num_seqs=64, kv_cache_memory=64 * 1024, mamba_ssm_cache_dtype="bfloat16",
              mamba_cache_dtype="bfloat16")  # fmt: skip
    assert [(c.dtype, r.dtype) for c, r in llm.llm_engine.runner.state_caches] == [(torch.bfloat16, torch.bfloat16)] * 3
    assert llm.llm_engine.block_manager.num_slots == 12
    assert_engine_greedy(llm, hf, seeded_prompts(5, 17, 30, seed=2), 6, "bfloat16 states")
    with pytest.raises(ValueError, match=r"mamba_ssm_cache_dtype must be one of \['auto', 'float32', 'bfloat16'"):
        LLM(model=model_dir, mamba_ssm_cache_dtype="fp8")


def write_block_fp8(model_dir, out) -> tuple:
    """``model_dir``'s checkpoint as the -FP8 releases store it (every projection, the linear layers'
    included, in float8 with a ``weight_scale_inv`` per 16 x 16 tile; embeddings, norms, routers,
    the convolution, ``A_log`` and ``dt_bias`` as they are), and its dense twin: (fp8 dir, dense dir)."""
    tensors, dense = {}, {}
    keep = ("embed", "norm", "lm_head", "mlp.gate.weight", "shared_expert_gate", "conv1d", "A_log", "dt_bias")
    for name, w in load_file(Path(model_dir) / "model.safetensors").items():
        if w.dim() == 2 and not any(k in name for k in keep):
            q, scale, dense[name] = _quantize(w.float(), "block", (16, 16))
            tensors[name], tensors[name + "_scale_inv"] = q, scale.float()
        else:
            tensors[name] = dense[name] = w
    return (checkpoint_like(Path(model_dir), out / "fp8", tensors, _block_fp8((16, 16))),
            checkpoint_like(Path(model_dir), out / "dense", dense))  # fmt: skip


def test_block_fp8_checkpoint_loads_as_its_dense_values(tiny, tmp_path):
    """Qwen3.5-MoE in block FP8 (experts and linear-layer projections included) loads as its dense
    values, and the engine gives transformers' greedy tokens on the dense twin."""
    model_dir, _ = tiny("moe")
    fp8, dense = write_block_fp8(model_dir, tmp_path)
    _assert_same_parameters(fp8, dense)
    hf = T.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    assert_engine_greedy(LLM(model=str(fp8), max_num_batched_tokens=16), hf, seeded_prompts(7, 19, seed=6), 8, "fp8")


def test_what_a_state_cannot_support_is_refused_by_name(tiny):
    model_dir, _ = tiny("dense")
    with pytest.raises(ValueError, match="speculative_config: not supported for a model with linear-attention"):
        LLM(model=model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="LoRA adapters are not supported for Qwen3_5ForCausalLM"):
        LLM(model=model_dir, enable_lora=True)
    with pytest.raises(ValueError, match="kv_cache_memory / gpu_memory_utilization: a sequence's linear-attention"):
        LLM(model=model_dir, kv_cache_memory=8 * 1024)


def test_states_take_at_most_half_the_kv_budget(tiny):
    """64 KiB of KV memory, a state of 5376 bytes per sequence: 6 slots (half the budget), so 6
    sequences run at once instead of max_num_seqs=64, and eight prompts still give transformers' tokens."""
    model_dir, hf = tiny("dense")
    llm = LLM(model=model_dir, max_num_seqs=64, kv_cache_memory=64 * 1024)
    engine = llm.llm_engine
    assert engine.scheduler.config.max_num_seqs == engine.block_manager.num_slots == 6
    assert engine.block_manager.num_blocks == (64 * 1024 - 6 * 5376) // (16 * 2 * 2 * 16 * 4)
    assert_engine_greedy(llm, hf, seeded_prompts(3, 8, 13, 4, 9, 11, 6, 7, seed=8), 8, "six slots")
