"""Nemotron-H hybrids (NemotronHForCausalLM): Mamba2, attention, MLP-only and MoE blocks, through the
whole engine, equal to transformers on tiny random checkpoints: a Nemotron-3-Nano-like mix (MoE with a
latent projection and two router groups) and a Nano-v2-like dense one (config.json in the older
``hybrid_override_pattern`` form, one B/C group); only the attention layers page K/V, only the
Mamba layers keep a state, the MLP / MoE blocks neither; prompts span several 8-token scan chunks."""
from __future__ import annotations

import copy
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from helpers import random_models, save_tiny_model, seeded_prompts
from test_architectures import assert_engine_greedy
from test_qwen3_5 import (assert_missing_tensor_named, assert_forked_siblings_match, assert_hybrid_matches, assert_preemption_keeps_tokens, randomize_mamba2)  # fmt: skip
from vllmini import LLM
from vllmini.models.nemotron_h import NemotronHForCausalLM, layer_kinds

# Mamba2 with 4 heads of 16 (64 wide: ``expand`` 2 would say 128, and neither side reads it), d_state 16,
# chunks of 8; attention 4 heads (2 KV) of 16, no RoPE; MLP layers relu^2, 96 wide
_SHAPE = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              intermediate_size=96, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, expand=2, conv_kernel=4,
              chunk_size=8, max_position_embeddings=512, initializer_range=0.2, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, architectures=["NemotronHForCausalLM"])  # fmt: skip
_KINDS = {
    # Nemotron-3-Nano's form: every block kind, 8 experts in 2 groups (the best 1 kept), a latent size
    "moe": dict(layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention"], n_groups=2,
                n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
                n_group=2, topk_group=1, moe_latent_size=24, routed_scaling_factor=2.5),
    # Nano-v2's form: no experts, one B/C group (config.json rewritten to hybrid_override_pattern "M-*-M")
    "dense": dict(layers_block_type=["linear_attention", "mlp", "full_attention", "mlp", "linear_attention"], n_groups=1),
    # experts without latent projections or groups, weights not renormalised; biases on the Mamba projections, none on its conv
    "plain": dict(layers_block_type=["full_attention", "moe", "linear_attention", "moe"], n_groups=2, n_routed_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=40, n_group=1,
                  topk_group=1, moe_latent_size=None, norm_topk_prob=False, use_bias=True, use_conv_bias=False),
}  # fmt: skip


def save_random(kind: str, out, tokenizer_dir):
    """Seed 0, every norm, ``dt_bias``, ``A_log``, ``D``, the conv bias, the projections' biases and the
    router's correction bias randomised, so none loads unseen."""
    torch.manual_seed(0)
    hf = T.AutoModelForCausalLM.from_config(T.NemotronHConfig(**{**_SHAPE, **_KINDS[kind]})).eval()
    randomize_mamba2(hf, ("bias", "e_score_correction_bias"))
    model_dir = save_tiny_model(hf, out, tokenizer_dir)
    if kind == "dense":
        config = json.loads((model_dir / "config.json").read_text())
        del config["layers_block_type"]
        (model_dir / "config.json").write_text(json.dumps(config | {"hybrid_override_pattern": "M-*-M"}))
    return str(model_dir), hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    return random_models(None, tmp_path_factory, default_model_dir, save=save_random)


@pytest.mark.parametrize(("kind", "backend"), [("moe", "cpu"), ("dense", "torch"), ("plain", "cpu")])
def test_greedy_and_logits_match_transformers(tiny, kind, backend):
    """Last-position logits of a flat batch within 1e-4 of transformers' (in float64); greedy tokens of
    five prompts through four sequence slots, prefilled in chunks of 16 beside decode rows, equal to
    transformers'."""
    model_dir, hf = tiny(kind)
    assert_hybrid_matches(model_dir, hf, backend, kind)


def test_only_attention_pages_kv_and_only_mamba_keeps_state(tiny):
    """One KV cache pair (the one attention layer), a conv and an SSM state per Mamba layer and slot;
    the MLP / MoE blocks take neither; the older ``hybrid_override_pattern`` built the same layers."""
    model_dir, _ = tiny("dense")
    assert "hybrid_override_pattern" in json.loads(open(f"{model_dir}/config.json").read())
    llm = LLM(model=model_dir, max_num_seqs=3)
    assert llm.llm_engine.model.kinds == ["linear_attention", "mlp", "full_attention", "mlp", "linear_attention"]
    runner = llm.llm_engine.runner
    assert len(runner.kv_caches) == 1
    conv = 64 + 2 * 1 * 16
    assert [(tuple(c.shape), tuple(s.shape), s.dtype) for c, s in runner.state_caches] == \
        [((3, conv, 3), (3, 4, 16, 16), torch.float32)] * 2  # fmt: skip


def test_n_siblings_fork_the_prompt_state(tiny):
    assert_forked_siblings_match(*tiny("moe"))


def test_preempted_sequences_recompute_their_state(tiny):
    assert_preemption_keeps_tokens(*tiny("dense"))


def test_async_scheduling_continuations_carry_the_state(tiny):
    model_dir, hf = tiny("plain")
    llm = LLM(model=model_dir, async_scheduling=True, max_num_batched_tokens=16)
    assert_engine_greedy(llm, hf, seeded_prompts(5, 17, 30, seed=2), 10, "async scheduling")


def test_mtp_tensors_are_skipped_and_stacked_experts_load(tiny, tmp_path):
    """A release's multi-token-prediction tensors (``mtp.*``) are skipped; experts stacked as
    transformers holds them (``mixer.experts.up_proj [E, I, D]``) load as the per-expert ones."""
    model_dir, hf = tiny("moe")
    out = shutil.copytree(model_dir, tmp_path / "mtp")
    tensors = load_file(out / "model.safetensors")
    for proj in ("up_proj", "down_proj"):
        per_expert = [tensors.pop(f"backbone.layers.1.mixer.experts.{e}.{proj}.weight") for e in range(8)]
        tensors[f"backbone.layers.1.mixer.experts.{proj}"] = torch.stack(per_expert)
    tensors["mtp.layers.0.norm.weight"] = torch.ones(64)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    assert_engine_greedy(LLM(model=str(out)), hf, seeded_prompts(13, 4, seed=7), 6, "stacked experts")


def test_what_the_model_cannot_support_is_refused_by_name(tiny):
    model_dir, hf = tiny("dense")
    with pytest.raises(ValueError, match="LoRA adapters are not supported for NemotronHForCausalLM"):
        LLM(model=model_dir, enable_lora=True)
    for field, value, message in [("layers_block_type", ["linear_attention", "mlp"], "no 'full_attention' layer"),
                                  ("layers_block_type", ["full_attention", "conv"], "layers_block_type"),
                                  ("n_groups", 3, "n_groups"),
                                  ("mlp_hidden_act", "silu", "mlp_hidden_act"),
                                  ("mamba_hidden_act", "gelu", "mamba_hidden_act"),
                                  ("time_step_limit", (1.0, 0.5), "time_step_limit")]:  # fmt: skip
        config = copy.deepcopy(hf.config)
        object.__setattr__(config, field, value)
        with pytest.raises(ValueError, match=message):
            NemotronHForCausalLM(config)
    assert layer_kinds(SimpleNamespace(hybrid_override_pattern="M-*E")) == ["linear_attention", "mlp", "full_attention", "moe"]
    with pytest.raises(ValueError, match="hybrid_override_pattern may hold only"):
        layer_kinds(SimpleNamespace(hybrid_override_pattern="M-*X"))
    config = copy.deepcopy(tiny("moe")[1].config)
    object.__setattr__(config, "n_group", 3)
    with pytest.raises(ValueError, match="n_group"):
        NemotronHForCausalLM(config)


@pytest.mark.parametrize(("kind", "tensor"), [("moe", "backbone.layers.1.mixer.experts.5.down_proj.weight"),
                                              ("moe", "backbone.layers.1.mixer.gate.e_score_correction_bias"),
                                              ("moe", "backbone.layers.2.mixer.k_proj.weight"),
                                              ("dense", "backbone.layers.4.mixer.norm.weight"),
                                              ("dense", "backbone.layers.3.mixer.up_proj.weight"),
                                              ("dense", "backbone.norm_f.weight")])  # fmt: skip
def test_missing_tensor_named_as_the_checkpoint_names_it(tiny, tmp_path, kind, tensor):
    assert_missing_tensor_named(tiny(kind)[0], tmp_path / "missing", tensor)
