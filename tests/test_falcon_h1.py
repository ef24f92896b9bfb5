"""Falcon-H1 (FalconH1ForCausalLM): every layer runs attention (paged KV) and a Mamba2 mixer (a
per-sequence state) side by side, through the whole engine, equal to transformers on tiny random
checkpoints whose every muP multiplier is set away from 1 (so a dropped one shows): the gated
RMSNorm normalising before the gate with projection biases ("norm"); no Mamba norm, tied
embeddings, two B/C groups and attention heads of ``head_dim`` ("plain"). Prompts span several of
the scan's 8-token chunks, and the states survive chunked prefill, forking (n > 1) and preemption."""
from __future__ import annotations

import copy
import shutil

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from helpers import prompt_forward, random_models, save_tiny_model, seeded_prompts
from test_qwen3_5 import (assert_fields_refused, assert_missing_tensor_named, assert_forked_siblings_match, assert_hybrid_matches, assert_preemption_keeps_tokens, float64_logits,
                         randomize_mamba2)  # fmt: skip
from vllmini import LLM, SamplingParams
from vllmini.models.falcon_h1 import FalconH1ForCausalLM

# 3 layers of attention (4 heads of 16, 2 KV heads) beside Mamba2 (4 heads of 16, d_state 16, chunks of 8)
_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, mamba_d_ssm=64,
              mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=8,
              rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
              embedding_multiplier=1.7, lm_head_multiplier=0.6, mlp_multipliers=[1.4, 0.7], key_multiplier=0.8,
              attention_in_multiplier=1.3, attention_out_multiplier=0.75, ssm_in_multiplier=1.2,
              ssm_out_multiplier=0.65, ssm_multipliers=[0.5, 1.5, 0.8, 1.25, 0.6],
              pad_token_id=0, bos_token_id=1, eos_token_id=2, architectures=["FalconH1ForCausalLM"])  # fmt: skip
_KINDS = {"norm": dict(mamba_n_groups=1, mamba_rms_norm=True, mamba_norm_before_gate=True, mamba_proj_bias=True,
                       projectors_bias=True, attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
          # head_dim apart from hidden / heads, as Falcon-H1-1.5B-Deep's (1280 wide, 6 heads of 128)
          "plain": dict(mamba_n_groups=2, mamba_rms_norm=False, mamba_d_ssm=None, mamba_expand=1, head_dim=24,
                        tie_word_embeddings=True)}  # fmt: skip
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
# multiplier -> a neutral value, to show each one matters on these weights
_NEUTRAL = {"embedding_multiplier": 1.0, "lm_head_multiplier": 1.0, "mlp_multipliers": [1.0, 1.0], "key_multiplier": 1.0,
            "attention_in_multiplier": 1.0, "attention_out_multiplier": 1.0, "ssm_in_multiplier": 1.0,
            "ssm_out_multiplier": 1.0, "ssm_multipliers": [1.0] * 5}  # fmt: skip


def save_random(kind: str, out, tokenizer_dir):
    """Seed 0, every norm (the gated one too), bias, ``dt_bias``, ``A_log`` and ``D`` randomised, so none loads unseen."""
    torch.manual_seed(0)
    hf = T.AutoModelForCausalLM.from_config(T.FalconH1Config(**{**_SHAPE, **_KINDS[kind]})).eval()
    randomize_mamba2(hf, ("bias",))
    return str(save_tiny_model(hf, out, tokenizer_dir)), hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    return random_models(None, tmp_path_factory, default_model_dir, save=save_random)


@pytest.mark.parametrize(("kind", "backend"), [("norm", "cpu"), ("plain", "torch")])
def test_greedy_and_logits_match_transformers(tiny, kind, backend):
    """Last-position logits of a flat batch within 1e-4 of transformers' (in float64); greedy tokens of
    five prompts through four sequence slots, prefilled in chunks of 16 beside decode rows (each chunk
    continuing the KV and the state the one before left), equal to transformers'."""
    model_dir, hf = tiny(kind)
    assert_hybrid_matches(model_dir, hf, backend, kind)


def test_every_multiplier_matters(tiny):
    """Each muP multiplier set back to 1 moves transformers' logits well past the 1e-4 the parity test
    allows, so none of them can be dropped unseen."""
    _, hf = tiny("norm")
    prompts = seeded_prompts(19, seed=7)
    want = float64_logits(hf, prompts)
    for field, neutral in _NEUTRAL.items():
        config = copy.deepcopy(hf.config)
        setattr(config, field, neutral)
        other = T.AutoModelForCausalLM.from_config(config).eval()
        other.load_state_dict(hf.state_dict())
        assert (float64_logits(other, prompts) - want).abs().max() > 1e-3, field


def test_every_layer_pages_kv_and_keeps_a_state(tiny):
    """A KV cache pair and a conv state (model dtype) plus an SSM state (float32) per layer and slot."""
    model_dir, _ = tiny("plain")
    llm = LLM(model=model_dir, max_num_seqs=3)
    runner = llm.llm_engine.runner
    assert len(runner.kv_caches) == 3
    conv = 64 + 2 * 2 * 16
    assert [(tuple(c.shape), c.dtype, tuple(s.shape), s.dtype) for c, s in runner.state_caches] == \
        [((3, conv, 3), torch.float32, (3, 4, 16, 16), torch.float32)] * 3  # fmt: skip
    assert not llm.llm_engine.block_manager.enable_prefix_caching


def test_prompt_embeds_are_used_as_given(tiny):
    """prompt_embeds skip ``embedding_multiplier`` (transformers scales only the embeddings it looks up):
    the scaled table's rows give the token ids' greedy tokens."""
    model_dir, hf = tiny("norm")
    llm = LLM(model=model_dir, enable_prompt_embeds=True, max_num_batched_tokens=16)
    ids = seeded_prompts(13, 22, seed=8)
    with torch.no_grad():
        embeds = [hf.model.embed_tokens(torch.tensor(p)) * hf.config.embedding_multiplier for p in ids]
    by_ids = llm.generate([{"prompt_token_ids": p} for p in ids], GREEDY, use_tqdm=False)
    by_embeds = llm.generate([{"prompt_embeds": e} for e in embeds], GREEDY, use_tqdm=False)
    for a, b in zip(by_ids, by_embeds):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_n_siblings_fork_the_prompt_state(tiny):
    assert_forked_siblings_match(*tiny("norm"))


def test_preempted_sequences_recompute_their_state(tiny):
    assert_preemption_keeps_tokens(*tiny("plain"))


def test_what_a_state_cannot_support_is_refused_by_name(tiny):
    model_dir, hf = tiny("plain")
    with pytest.raises(ValueError, match="speculative_config: not supported for a model with linear-attention"):
        LLM(model=model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="LoRA adapters are not supported for FalconH1ForCausalLM"):
        LLM(model=model_dir, enable_lora=True)
    assert_fields_refused(FalconH1ForCausalLM, hf.config, [("mamba_n_groups", 3, "mamba_n_groups"), ("mamba_d_ssm", 48, "mamba_d_ssm"),
                                  ("ssm_multipliers", [1.0] * 4, "ssm_multipliers"),
                                  ("mlp_multipliers", [1.0], "mlp_multipliers")])  # fmt: skip


@pytest.mark.parametrize(("kind", "tensor"), [("norm", "model.layers.1.feed_forward.gate_proj.weight"),
                                              ("norm", "model.layers.2.mamba.norm.weight"),
                                              ("norm", "model.layers.0.pre_ff_layernorm.weight"),
                                              ("plain", "model.final_layernorm.weight")])  # fmt: skip
def test_missing_tensor_named_as_the_checkpoint_names_it(tiny, tmp_path, kind, tensor):
    assert_missing_tensor_named(tiny(kind)[0], tmp_path / "missing", tensor)


def test_a_saved_mup_vector_is_ignored(tiny, tmp_path):
    """A checkpoint holding ``mamba.mup_vector`` (transformers' unsaved buffer) loads, the multipliers still
    from config.json: the logits stay transformers'."""
    model_dir, hf = tiny("norm")
    out = shutil.copytree(model_dir, tmp_path / "mup")
    tensors = load_file(out / "model.safetensors")
    for i in range(3):
        tensors[f"model.layers.{i}.mamba.mup_vector"] = torch.zeros(1, 1, 2 * 64 + 2 * 16 + 4)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    prompts = seeded_prompts(17, seed=9)
    llm = LLM(model=str(out))
    torch.testing.assert_close(prompt_forward(llm.llm_engine.model, prompts), float64_logits(hf, prompts), atol=1e-4, rtol=0)
