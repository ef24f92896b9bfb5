"""Granite 4.0 hybrids (GraniteMoeHybridForCausalLM): Mamba2 layers with a per-sequence state beside
Granite attention layers with a paged KV cache, through the whole engine, equal to transformers on
tiny random checkpoints (MoE + shared MLP with RoPE and one B/C group; dense shared MLP only, NoPE,
tied embeddings, two groups); prompts span several of the scan's 8-token chunks, and the state survives chunked
prefill, forking (n > 1) and preemption."""
from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
import transformers as T

from helpers import prompt_forward, random_models, save_tiny_model, seeded_prompts
from test_architectures import assert_engine_greedy
from test_qwen3_5 import (assert_fields_refused, assert_missing_tensor_named, assert_forked_siblings_match, assert_hybrid_matches, assert_preemption_keeps_tokens, float64_logits,
                         randomize_mamba2)  # fmt: skip
from vllmini import LLM, SamplingParams
from vllmini.models.granite4 import GraniteMoeHybridForCausalLM

# 4 layers: mamba, mamba, attention, mamba; Mamba2 with 8 heads of 16 (expand 2), d_state 16, chunks of 8
_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=32, shared_intermediate_size=48, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
              layer_types=["mamba", "mamba", "attention", "mamba"], mamba_n_heads=8, mamba_d_head=16, mamba_expand=2,
              mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=8, embedding_multiplier=2.0, residual_multiplier=0.5,
              attention_multiplier=0.2, logits_scaling=1.5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, architectures=["GraniteMoeHybridForCausalLM"])  # fmt: skip
_KINDS = {"moe": dict(num_local_experts=4, num_experts_per_tok=2, mamba_n_groups=1, position_embedding_type="rope"),
          # H-Micro's form: no experts (num_experts_per_tok 0 too), NoPE, tied embeddings
          "dense": dict(num_local_experts=0, num_experts_per_tok=0, mamba_n_groups=2, position_embedding_type="nope",
                        tie_word_embeddings=True),
          "dt_limit": dict(num_local_experts=0, mamba_n_groups=2, position_embedding_type="rope", time_step_limit=(0.0, 0.3))}  # fmt: skip
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def save_random(kind: str, out, tokenizer_dir):
    """Seed 0, every norm (the gated one too), ``dt_bias``, ``A_log``, ``D`` and the convolution's bias randomised,
    so none loads unseen."""
    torch.manual_seed(0)
    hf = T.AutoModelForCausalLM.from_config(T.GraniteMoeHybridConfig(**{**_SHAPE, **_KINDS[kind]})).eval()
    randomize_mamba2(hf, ("conv1d.bias",))
    return str(save_tiny_model(hf, out, tokenizer_dir)), hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    return random_models(None, tmp_path_factory, default_model_dir, save=save_random)


def hf_greedy_uncached(hf, prompt: list[int], max_new: int) -> list[int]:
    """transformers' greedy tokens by a whole forward per step (its chunked scan clamps dt to
    ``time_step_limit`` at every position; its cached one-token step does not)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize(("kind", "backend"), [("moe", "cpu"), ("dense", "torch")])
def test_greedy_and_logits_match_transformers(tiny, kind, backend):
    """Last-position logits of a flat batch within 1e-4 of transformers' (in float64); greedy tokens of
    five prompts through four sequence slots, prefilled in chunks of 16 beside decode rows (each chunk
    continuing the state the one before left), equal to transformers'."""
    model_dir, hf = tiny(kind)
    assert_hybrid_matches(model_dir, hf, backend, kind)


def test_time_step_limit_clamps_every_step(tiny):
    """``time_step_limit`` (0, 0.3) changes the logits (the clamp bites on these weights); ours equal
    transformers' whole forward, and greedy decoding clamps each decode step as the prompt's."""
    model_dir, hf = tiny("dt_limit")
    prompts = seeded_prompts(29, 12, seed=6)
    want = float64_logits(hf, prompts)
    unclamped = copy.deepcopy(hf)
    for layer in unclamped.model.layers:
        if layer.mamba is not None:
            layer.mamba.time_step_limit = (0.0, float("inf"))
    assert (float64_logits(unclamped, prompts) - want).abs().max() > 1e-2
    llm = LLM(model=model_dir, max_num_batched_tokens=16, max_num_seqs=4)
    torch.testing.assert_close(prompt_forward(llm.llm_engine.model, prompts), want, atol=1e-4, rtol=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy_uncached(hf, p, 12)


def test_only_attention_layers_page_their_kv(tiny, tmp_path):
    """One KV cache pair (the attention layer), a conv state (model dtype) and an SSM state (float32)
    per Mamba layer and slot; the releases' layer names ("mamba" / "attention") load the same."""
    model_dir, hf = tiny("dense")
    out = shutil.copytree(model_dir, tmp_path / "names")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"layer_types": ["mamba", "mamba", "attention", "mamba"]}))
    llm = LLM(model=str(out), max_num_seqs=3)
    runner = llm.llm_engine.runner
    assert len(runner.kv_caches) == 1
    conv = 128 + 2 * 2 * 16
    assert [(tuple(c.shape), c.dtype, tuple(s.shape), s.dtype) for c, s in runner.state_caches] == \
        [((3, conv, 3), torch.float32, (3, 8, 16, 16), torch.float32)] * 3  # fmt: skip
    assert not llm.llm_engine.block_manager.enable_prefix_caching
    assert_engine_greedy(llm, hf, seeded_prompts(11, 5, seed=1), 6, "release layer names")


def test_n_siblings_fork_the_prompt_state(tiny):
    """``n = 3`` with ``top_k=1``: the siblings forked after the prompt (not prefilled again) continue a
    copy of its Mamba states, so all three give transformers' tokens."""
    assert_forked_siblings_match(*tiny("moe"))


def test_preempted_sequences_recompute_their_state(tiny):
    """Too few KV blocks for four sequences at once: the newest are preempted and later recomputed
    from zeros in a free slot, to transformers' tokens."""
    assert_preemption_keeps_tokens(*tiny("dense"))


def test_async_scheduling_continuations_carry_the_state(tiny):
    model_dir, hf = tiny("moe")
    llm = LLM(model=model_dir, async_scheduling=True, max_num_batched_tokens=16)
    assert_engine_greedy(llm, hf, seeded_prompts(5, 17, 30, seed=2), 10, "async scheduling")


def test_what_a_state_cannot_support_is_refused_by_name(tiny):
    model_dir, hf = tiny("dense")
    with pytest.raises(ValueError, match="speculative_config: not supported for a model with linear-attention"):
        LLM(model=model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="LoRA adapters are not supported for GraniteMoeHybridForCausalLM"):
        LLM(model=model_dir, enable_lora=True)
    assert_fields_refused(GraniteMoeHybridForCausalLM, hf.config, [("layer_types", ["mamba"] * 4, "no 'attention' layer"),
                                  ("layer_types", ["mamba", "conv", "attention", "mamba"], "layer_types must name"),
                                  ("mamba_n_groups", 3, "mamba_n_groups"),
                                  ("position_embedding_type", "alibi", "position_embedding_type"),
                                  ("time_step_limit", (1.0, 0.5), "time_step_limit")])  # fmt: skip


@pytest.mark.parametrize(("kind", "tensor"), [("moe", "model.layers.1.shared_mlp.input_linear.weight"),
                                              ("moe", "model.layers.0.block_sparse_moe.router.layer.weight"),
                                              ("dense", "model.layers.3.shared_mlp.output_linear.weight")])  # fmt: skip
def test_missing_tensor_named_as_the_checkpoint_names_it(tiny, tmp_path, kind, tensor):
    assert_missing_tensor_named(tiny(kind)[0], tmp_path / "missing", tensor)
