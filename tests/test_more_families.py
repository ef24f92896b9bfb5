"""MiniMax-M2, Seed-OSS, OLMoE, Cohere / Cohere2 and dots.llm1 through the whole engine, equal to transformers
on tiny random checkpoints it saved (tests/test_glm.py's way)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Cohere2Config, CohereConfig, Dots1Config, MiniMaxM2Config, OlmoeConfig, SeedOssConfig

from helpers import hf_last_logits, prompt_forward, random_models, seeded_prompts
from test_architectures import assert_chunked_batch_matches, assert_prefix_hit_keeps_tokens
from vllmini import LLM

_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip


def tiny_config(kind: str):
    """``minimax_m2``: 8 experts 32 wide (top 2), rope on the first 8 of 16 dims, MTP declared;
    ``seed_oss``: heads 24 wide (not hidden / heads), q/k/v and MLP biases, none on o_proj;
    ``olmoe``: 8 experts 32 wide, top 2 not renormalised; ``cohere`` / ``cohere2``: tied, logits scaled,
    Cohere2's layers sliding, full (NoPE), sliding; ``dots1``: GLM-4.5's MoE plan under Qwen3's attention."""
    if kind == "minimax_m2":
        return MiniMaxM2Config(**{**_SHAPE, "intermediate_size": 32}, head_dim=16, rotary_dim=8, rms_norm_eps=1e-5,
                               num_local_experts=8, num_experts_per_tok=2, num_mtp_modules=1,
                               architectures=["MiniMaxM2ForCausalLM"])  # fmt: skip
    if kind == "seed_oss":  # the release's q/k/v biases without o_proj's; MLP biases on
        return SeedOssConfig(**_SHAPE, head_dim=24, rms_norm_eps=1e-5, attention_bias=True, attention_out_bias=False,
                             mlp_bias=True,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                             architectures=["SeedOssForCausalLM"])  # fmt: skip
    if kind == "olmoe":  # the release's softmax top-k left unnormalised; q/k/v/o biases on
        return OlmoeConfig(**{**_SHAPE, "intermediate_size": 32}, rms_norm_eps=1e-5, num_experts=8,
                           num_experts_per_tok=2, norm_topk_prob=False, attention_bias=True,
                           architectures=["OlmoeForCausalLM"])  # fmt: skip
    if kind == "cohere":  # Command R: tied, logit_scale, q/k/v/o biases on
        return CohereConfig(**{**_SHAPE, "tie_word_embeddings": True}, layer_norm_eps=1e-5, logit_scale=0.5,
                            attention_bias=True, architectures=["CohereForCausalLM"])  # fmt: skip
    if kind == "cohere2":  # Command R7B's pattern: sliding (12 keys) with rope, then a full NoPE layer
        return Cohere2Config(**{**_SHAPE, "tie_word_embeddings": True}, head_dim=16, layer_norm_eps=1e-5,
                             logit_scale=0.5, sliding_window=12, sliding_window_pattern=2,
                             architectures=["Cohere2ForCausalLM"])  # fmt: skip
    if kind == "dots1":  # a dense first layer, then 8 experts in 2 groups (top 2 of the best group), a shared
        # expert, renormalised and scaled; per-head q/k norm; the last two layers slide (12 keys)
        return Dots1Config(**_SHAPE, head_dim=24, rms_norm_eps=1e-5, attention_bias=True, moe_intermediate_size=32,
                           n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=1,
                           first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.0,
                           sliding_window=12, max_window_layers=1, architectures=["Dots1ForCausalLM"])  # fmt: skip
    raise KeyError(kind)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    return random_models(tiny_config, tmp_path_factory, default_model_dir)


_prompts = seeded_prompts


def _with_config(model_dir: str, out, **fields) -> str:
    """A copy of ``model_dir`` with ``fields`` set in its config.json."""
    out = shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **fields}))
    return str(out)


@pytest.mark.parametrize(("kind", "backend"), [("minimax_m2", "cpu"), ("minimax_m2", "torch"),
                                                     ("seed_oss", "cpu"), ("olmoe", "cpu"), ("olmoe", "torch"),
                                                     ("cohere", "cpu"), ("cohere2", "cpu"), ("cohere2", "torch"),
                                                     ("dots1", "cpu"), ("dots1", "torch")])
def test_greedy_and_logits_match_transformers(tiny, kind, backend):
    """Last-position logits of a flat batch within 1e-4; greedy tokens of a batch of mixed lengths,
    prefilled in chunks of 16 beside decode rows, equal to transformers'."""
    model_dir, hf = tiny(kind)
    assert_chunked_batch_matches(model_dir, hf, backend, _prompts(1, 9, 37, 20, 3), kind)


@pytest.mark.parametrize("kind", ["minimax_m2", "olmoe", "cohere2", "dots1"])
def test_prefix_cache_hit_keeps_tokens(tiny, kind):
    """A prefix-cache hit skips the shared blocks and changes no token."""
    model_dir, hf = tiny(kind)
    assert_prefix_hit_keeps_tokens(model_dir, hf, _prompts(48)[0], _prompts(11, 20))


def test_minimax_m2_checkpoint_names_and_mtp(tiny, tmp_path):
    """The checkpoint's names (``block_sparse_moe.experts.<e>.w1``, its ``e_score_correction_bias``
    beside the gate) load; an MTP module stored as ``model.layers.<num_hidden_layers>`` is skipped."""
    model_dir, hf = tiny("minimax_m2")
    out = shutil.copytree(model_dir, tmp_path / "mtp")
    tensors = load_file(out / "model.safetensors")
    assert {"model.layers.0.block_sparse_moe.experts.7.w3.weight",
            "model.layers.0.block_sparse_moe.e_score_correction_bias"} <= set(tensors)  # fmt: skip
    mtp = {name.replace("model.layers.1.", "model.layers.3."): t.clone() for name, t in tensors.items()
           if name.startswith("model.layers.1.")}  # fmt: skip
    save_file({**tensors, **mtp}, out / "model.safetensors", metadata={"format": "pt"})
    model = LLM(model=str(out)).llm_engine.model
    prompts = _prompts(12)
    torch.testing.assert_close(prompt_forward(model, prompts), hf_last_logits(hf, prompts), atol=1e-4, rtol=0)
    del tensors["model.layers.2.block_sparse_moe.e_score_correction_bias"]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.2\.block_sparse_moe\.e_score_correction_bias"):
        LLM(model=str(out))


@pytest.mark.parametrize(("kind", "field", "value", "message"), [
    ("minimax_m2", "scoring_func", "softmax", "scoring_func 'softmax' is not supported"),
    ("minimax_m2", "qk_norm_type", "per_head", "qk_norm_type 'per_head' is not supported"),
    ("olmoe", "clip_qkv", 8.0, "clip_qkv=8.0 is not supported"),
    ("cohere", "use_qk_norm", True, "use_qk_norm=true .* is not supported"),
])  # fmt: skip
def test_unbuilt_config_is_refused_by_name(tiny, tmp_path, kind, field, value, message):
    model_dir, _ = tiny(kind)
    with pytest.raises(ValueError, match=message):
        LLM(model=_with_config(model_dir, tmp_path / "bad", **{field: value}))
