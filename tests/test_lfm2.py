"""LFM2 and LFM2-MoE: short-convolution layers with a per-sequence state (the convolution's last inputs) beside
full-attention layers with a paged KV cache, through the whole engine, equal to transformers on a
tiny random checkpoint; the state survives chunked prefill, forking (n > 1) and preemption."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers as T

from helpers import random_models, save_tiny_model, seeded_prompts
from test_architectures import assert_chunked_batch_matches, assert_engine_greedy
from test_qwen3_5 import assert_forked_siblings_match, assert_preemption_keeps_tokens
from vllmini import LLM
from vllmini.models.lfm2 import lfm2_ffn_size

# conv, conv, attention, conv; biases on (conv_bias); the MLP width auto-adjusted: int(2 * 96 / 3) = 64,
# times 1.3 = 83, rounded up to a multiple of 40: 120
_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, conv_L_cache=3,
              conv_bias=True, layer_types=["conv", "conv", "full_attention", "conv"], block_auto_adjust_ff_dim=True,
              block_ffn_dim_multiplier=1.3, block_multiple_of=40, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
# LFM2-MoE: a dense first layer (intermediate_size as it is), then 8 experts, top 2 by sigmoid score plus
# expert_bias, renormalised and scaled by 1.5; no conv biases (the releases' setting)
_MOE = dict({k: v for k, v in _SHAPE.items() if not k.startswith("block_")}, conv_bias=False, num_dense_layers=1,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, routed_scaling_factor=1.5)  # fmt: skip


def tiny_config(kind: str):
    if kind == "dense":
        return T.Lfm2Config(**_SHAPE, architectures=["Lfm2ForCausalLM"])
    return T.Lfm2MoeConfig(**_MOE, architectures=["Lfm2MoeForCausalLM"])


def save_random(kind: str, out, tokenizer_dir):
    """Seed 0; every norm (near 1), bias and expert_bias randomised, so none loads unseen."""
    torch.manual_seed(0)
    hf = T.AutoModelForCausalLM.from_config(tiny_config(kind)).eval()
    with torch.no_grad():
        for name, tensor in [*hf.named_parameters(), *hf.named_buffers()]:
            if "norm" in name:
                tensor.normal_(1.0, 0.3)
            elif name.endswith("bias"):
                tensor.normal_(0.0, 0.2)
    return str(save_tiny_model(hf, out, tokenizer_dir)), hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    return random_models(None, tmp_path_factory, default_model_dir, save=save_random)


@pytest.mark.parametrize(("kind", "backend"), [("dense", "cpu"), ("dense", "torch"), ("moe", "cpu")])
def test_greedy_and_logits_match_transformers(tiny, kind, backend):
    """Last-position logits of a flat batch within 1e-4 of transformers'; greedy tokens of five prompts
    through four sequence slots, prefilled in chunks of 16 beside decode rows (each chunk continuing
    the convolution state the one before left), equal to transformers'."""
    model_dir, hf = tiny(kind)
    assert_chunked_batch_matches(model_dir, hf, backend, seeded_prompts(1, 9, 37, 20, 3), f"lfm2 {kind} {backend}")


def test_only_attention_layers_page_their_kv(tiny):
    """One KV cache pair (the attention layer); one state tensor per conv layer: its last K-1 inputs."""
    model_dir, hf = tiny("dense")
    llm = LLM(model=model_dir, max_num_seqs=3)
    runner = llm.llm_engine.runner
    assert len(runner.kv_caches) == 1
    assert [tuple(tuple(t.shape) for t in layer) for layer in runner.state_caches] == [((3, 64, 2),)] * 3
    assert lfm2_ffn_size(hf.config) == 120 == llm.llm_engine.model.model.layers[0].mlp.intermediate_size


def test_n_siblings_fork_the_prompt_state(tiny):
    """``n = 3`` greedy siblings forked after the prompt continue a copy of its convolution state."""
    assert_forked_siblings_match(*tiny("dense"))


def test_preempted_sequences_recompute_their_state(tiny):
    """Too few KV blocks for four sequences: the newest are preempted, recomputed from zeros in a free
    slot, to transformers' tokens."""
    assert_preemption_keeps_tokens(*tiny("dense"))


def test_older_full_attn_idxs_config(tiny, tmp_path):
    """A config.json of the first releases (``full_attn_idxs``, ``block_ff_dim``, ``tie_embedding``; no
    ``layer_types``, ``intermediate_size``, ``tie_word_embeddings``) gives the same model."""
    model_dir, hf = tiny("dense")
    out = shutil.copytree(model_dir, tmp_path / "old")
    config = json.loads((out / "config.json").read_text())
    for key in ("layer_types", "intermediate_size", "tie_word_embeddings"):
        del config[key]
    config.update(full_attn_idxs=[2], block_ff_dim=96, tie_embedding=True)
    (out / "config.json").write_text(json.dumps(config))
    llm = LLM(model=str(out), max_num_batched_tokens=16)
    assert [layer.linear_attn is None for layer in llm.llm_engine.model.model.layers] == [False, False, True, False]
    assert_engine_greedy(llm, hf, seeded_prompts(4, 19, seed=6), 8, "full_attn_idxs")


def test_what_a_state_cannot_support_is_refused_by_name(tiny):
    model_dir, _ = tiny("dense")
    with pytest.raises(ValueError, match="speculative_config: not supported for a model with linear-attention"):
        LLM(model=model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="LoRA adapters are not supported for Lfm2ForCausalLM"):
        LLM(model=model_dir, enable_lora=True)
