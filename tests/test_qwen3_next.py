"""Qwen3-Next: transformers' checkpoints (fused, head-grouped ``in_proj_qkvz`` / ``in_proj_ba``,
experts in some layers only) served by Qwen3.5's hybrid decoder, equal to transformers on a tiny
random checkpoint through the whole engine."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from helpers import prompt_forward, random_models, save_tiny_model, seeded_prompts
from test_architectures import assert_engine_greedy
from test_qwen3_5 import float64_logits, randomize_gated_deltanet
from vllmini import LLM
from vllmini.models.moe import FusedMoE

# three linear-attention layers then a full-attention one; experts in every layer but layer 1
_CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.2,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
               linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[1],
               pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
               architectures=["Qwen3NextForCausalLM"])  # fmt: skip


def save_random(kind: str, out, tokenizer_dir):
    """Seed 0; the zero-centred norms' weights (offsets from 1) near 0, the linear layers' gated
    norm near 1, ``dt_bias`` near 1 and ``A_log`` randomised, so that none loads unseen."""
    torch.manual_seed(0)
    hf = randomize_gated_deltanet(T.AutoModelForCausalLM.from_config(T.Qwen3NextConfig(**_CONFIG)).eval())
    return str(save_tiny_model(hf, out, tokenizer_dir)), hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    return random_models(None, tmp_path_factory, default_model_dir, save=save_random)


def test_checkpoint_holds_the_fused_projections(tiny):
    """transformers saves the linear layers' projections fused (what the releases hold too)."""
    model_dir, _ = tiny("moe")
    names = set(load_file(f"{model_dir}/model.safetensors"))
    assert {"model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.0.linear_attn.in_proj_ba.weight",
            "model.layers.1.mlp.gate_proj.weight", "model.layers.0.mlp.experts.7.up_proj.weight"} <= names
    assert not any("in_proj_qkv." in n or "in_proj_z." in n for n in names)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_and_logits_match_transformers(tiny, backend):
    """Last-position logits of a flat batch within 1e-4 of transformers' (in float64); greedy tokens
    of five prompts through four sequence slots, prefilled in chunks of 16 beside decode rows,
    equal to transformers'. Layer 1 (``mlp_only_layers``) has a dense MLP, the others experts."""
    model_dir, hf = tiny("moe")
    prompts = seeded_prompts(1, 9, 37, 20, 3)
    llm = LLM(model=model_dir, max_num_batched_tokens=16, max_num_seqs=4, attention_backend=backend)
    model = llm.llm_engine.model
    assert type(model).__name__ == "Qwen3NextForCausalLM"
    assert [isinstance(layer.mlp, FusedMoE) for layer in model.model.layers] == [True, False, True, True]
    torch.testing.assert_close(prompt_forward(model, prompts), float64_logits(hf, prompts), atol=1e-4, rtol=0)
    assert_engine_greedy(llm, hf, prompts, 10, backend)
    assert llm.llm_engine.scheduler.stats.num_chunked_prefills > 0


def test_release_form_with_mtp_tensors_and_a_missing_fused_tensor(tiny, tmp_path):
    """The releases' form: config.json with ``full_attention_interval``, top-level ``rope_theta`` and
    ``partial_rotary_factor`` (no ``layer_types`` / ``rope_parameters``), and multi-token-prediction
    tensors (``mtp.*``, loaded as nothing): transformers' tokens. A checkpoint without a layer's
    ``in_proj_ba`` is refused naming that tensor (not our split names)."""
    model_dir, hf = tiny("moe")
    out = shutil.copytree(model_dir, tmp_path / "mtp")
    config = json.loads((out / "config.json").read_text())
    assert config.pop("layer_types") == ["linear_attention"] * 3 + ["full_attention"]
    rope = config.pop("rope_parameters")
    config.update(full_attention_interval=4, rope_theta=rope["rope_theta"], partial_rotary_factor=0.25)
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(out / "model.safetensors")
    tensors.update({"mtp.fc.weight": torch.zeros(64, 128), "mtp.layers.0.input_layernorm.weight": torch.ones(64)})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    assert_engine_greedy(LLM(model=str(out)), hf, seeded_prompts(7, 12, seed=3), 6, "with mtp.*")

    del tensors["model.layers.2.linear_attn.in_proj_ba.weight"]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    missing = r"provide these parameters: model\.layers\.2\.linear_attn\.in_proj_ba\.weight$"  # (once)
    with pytest.raises(ValueError, match=missing):
        LLM(model=str(out))


def test_block_fp8_checkpoint_loads_as_its_dense_values(tiny, tmp_path):
    """The -FP8 release form: the fused ``in_proj_qkvz`` / ``in_proj_ba`` in float8 with 16 x 16 tile
    scales (tiles crossing the key-head groups) are dequantized before they are split, and load as
    their dense values; greedy tokens equal transformers' on the dense twin."""
    from test_fp8_checkpoints import _assert_same_parameters
    from test_qwen3_5 import write_block_fp8

    model_dir, _ = tiny("moe")
    fp8, dense = write_block_fp8(model_dir, tmp_path)
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight_scale_inv" in load_file(fp8 / "model.safetensors")
    _assert_same_parameters(fp8, dense)
    hf = T.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    assert_engine_greedy(LLM(model=str(fp8), max_num_batched_tokens=16), hf, seeded_prompts(7, 19, seed=6), 8, "fp8")
