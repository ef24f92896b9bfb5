"""Hunyuan v1 (dense and MoE), Phi-3.5-MoE and StarCoder2 through the whole engine, equal to transformers
on tiny random checkpoints it saved (tests/test_more_families.py's way)."""
from __future__ import annotations

import pytest
from safetensors.torch import load_file
from transformers import HunYuanDenseV1Config, HunYuanMoEV1Config, PhimoeConfig, Starcoder2Config

from helpers import random_models, seeded_prompts
from test_architectures import assert_chunked_batch_matches
from test_more_families import _with_config
from vllmini import LLM

_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
# the releases' NTK-alpha rope: transformers reads it as a fixed base (its "ntk_alpha")
_ALPHA_ROPE = {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}


def tiny_config(kind: str):
    """``hunyuan_dense``: q/k/v/o biases, q/k norm after the NTK-alpha rope; ``hunyuan_moe``: 8 experts,
    top 2 renormalised, plus the shared MLP; ``phimoe``: LayerNorms with bias, attention and lm_head
    biases, sparsemixer top-2 over 8 experts, longrope (within the original context: short factors, short_mscale), sliding 12;
    ``starcoder2``: LayerNorms with bias, GELU c_fc/c_proj with biases, tied, sliding 12."""
    if kind == "hunyuan_dense":
        return HunYuanDenseV1Config(**_SHAPE, head_dim=16, attention_bias=True, rope_parameters=_ALPHA_ROPE,
                                    architectures=["HunYuanDenseV1ForCausalLM"])  # fmt: skip
    if kind == "hunyuan_moe":
        return HunYuanMoEV1Config(**_SHAPE, head_dim=16, num_experts=8, moe_topk=2, rope_parameters=_ALPHA_ROPE,
                                  architectures=["HunYuanMoEV1ForCausalLM"])  # fmt: skip
    if kind == "phimoe":
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 8 for i in range(8)],
                "long_factor": [2.0 + i for i in range(8)], "short_mscale": 1.2, "long_mscale": 1.5,
                "original_max_position_embeddings": 512}  # fmt: skip
        return PhimoeConfig(**_SHAPE, num_local_experts=8, num_experts_per_tok=2, attention_bias=True,
                            lm_head_bias=True, sliding_window=12, rope_parameters=rope,
                            architectures=["PhimoeForCausalLM"])  # fmt: skip
    if kind == "starcoder2":
        return Starcoder2Config(**{**_SHAPE, "tie_word_embeddings": True}, hidden_act="gelu_pytorch_tanh",
                                sliding_window=12, architectures=["Starcoder2ForCausalLM"])  # fmt: skip
    raise KeyError(kind)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    return random_models(tiny_config, tmp_path_factory, default_model_dir)


@pytest.mark.parametrize(("kind", "backend"), [("hunyuan_dense", "cpu"), ("hunyuan_moe", "torch"), ("phimoe", "cpu"),
                                               ("starcoder2", "cpu")])  # fmt: skip
def test_greedy_and_logits_match_transformers(tiny, kind, backend):
    """Last-position logits of a flat batch within 1e-4; greedy tokens of a batch of mixed lengths,
    prefilled in chunks of 16 beside decode rows (past the 12-token windows), equal to transformers'."""
    model_dir, hf = tiny(kind)
    assert_chunked_batch_matches(model_dir, hf, backend, seeded_prompts(1, 9, 37, 20, 3), kind)


def test_checkpoint_names(tiny):
    """The releases' names: Hunyuan's ``query_layernorm`` / ``mlp.gate.wg`` / ``mlp.shared_mlp``,
    Phi-3.5-MoE's ``block_sparse_moe.experts.<e>.w1``, StarCoder2's ``mlp.c_fc``."""
    expected = {"hunyuan_moe": {"model.layers.0.self_attn.query_layernorm.weight", "model.layers.1.mlp.gate.wg.weight",
                                "model.layers.0.mlp.shared_mlp.gate_proj.weight",
                                "model.layers.0.mlp.experts.7.down_proj.weight"},
                "phimoe": {"model.layers.0.block_sparse_moe.gate.weight",
                           "model.layers.1.block_sparse_moe.experts.7.w3.weight", "lm_head.bias",
                           "model.norm.bias"},
                "starcoder2": {"model.layers.0.mlp.c_fc.bias", "model.layers.1.input_layernorm.bias"}}  # fmt: skip
    for kind, names in expected.items():
        assert names <= set(load_file(f"{tiny(kind)[0]}/model.safetensors")), kind


@pytest.mark.parametrize(("kind", "field", "value", "message"), [
    ("hunyuan_dense", "use_cla", True, "use_cla=true .* is not supported"),
    ("hunyuan_moe", "moe_intermediate_size", [64, 64], r"moe_intermediate_size=\[64, 64\] is not supported"),
    ("phimoe", "num_experts_per_tok", 3, "num_experts_per_tok=3 is not supported"),
    ("starcoder2", "hidden_act", "relu", "hidden_act 'relu' is not supported"),
])  # fmt: skip
def test_unbuilt_config_is_refused_by_name(tiny, tmp_path, kind, field, value, message):
    model_dir, _ = tiny(kind)
    with pytest.raises(ValueError, match=message):
        LLM(model=_with_config(model_dir, tmp_path / "bad", **{field: value}))
