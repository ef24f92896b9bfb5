"""DeepSeek-V2 / V3 (multi-head latent attention over a latent KV cache, DeepSeek's MoE routing)
through the whole engine, equal to transformers on tiny random checkpoints it saved."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config

from helpers import (assert_engine_matches_transformers, assert_greedy_matches, hf_greedy, prompt_forward, random_models,
                     seeded_prompts)  # fmt: skip
from test_architectures import assert_chunked_batch_matches, assert_prefix_hit_keeps_tokens
from test_engine import assert_no_leaks
from test_fp8_checkpoints import _assert_same_parameters, _block_fp8, _dense_copy, _write_fp8
from vllmini import LLM, SamplingParams
from vllmini.models.deepseek import DeepseekV3ForCausalLM

_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
               num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
               max_position_embeddings=512, initializer_range=0.2, n_shared_experts=1,
               num_experts_per_tok=2)  # fmt: skip
_YARN = {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1,
         "original_max_position_embeddings": 64, "rope_theta": 10000.0}  # fmt: skip
LATENT = _COMMON["kv_lora_rank"] + _COMMON["qk_rope_head_dim"]  # values a token caches per layer


def tiny_config(kind: str, **overrides):
    """``v2lite``: no q_lora, greedy routing, a dense first layer; ``v2group``: q_lora, group_limited_greedy
    with a routed scale; ``v3``: q_lora, noaux_tc over 4 groups, renormalised, a dense first layer, YaRN
    with mscale_all_dim; ``v3_halves``: V3 with rope_interleave false."""
    if kind == "v2lite":
        features = dict(q_lora_rank=None, n_routed_experts=6, first_k_dense_replace=1, topk_method="greedy")
        return DeepseekV2Config(**_COMMON, **features, architectures=["DeepseekV2ForCausalLM"], **overrides)
    if kind == "v2group":
        features = dict(q_lora_rank=24, n_routed_experts=8, n_group=4, topk_group=2, routed_scaling_factor=1.5,
                        topk_method="group_limited_greedy")  # fmt: skip
        return DeepseekV2Config(**_COMMON, **features, architectures=["DeepseekV2ForCausalLM"], **overrides)
    features = dict(q_lora_rank=24, n_routed_experts=8, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                    first_k_dense_replace=1, norm_topk_prob=True, rope_parameters=dict(_YARN),
                    rope_interleave=kind != "v3_halves")  # fmt: skip
    return DeepseekV3Config(**_COMMON, **features, architectures=["DeepseekV3ForCausalLM"], **overrides)


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory, default_model_dir):
    """``get(kind)``: (folder, transformers model), random weights (norms and V3's correction bias too)."""
    return random_models(tiny_config, tmp_path_factory, default_model_dir)


_prompts = seeded_prompts


@pytest.mark.parametrize(("kind", "backend"), [("v2lite", "cpu"), ("v2group", "cpu"), ("v3", "cpu"), ("v3", "torch")])
def test_greedy_and_logits_match_transformers(tiny_deepseek, kind, backend):
    """Last-position logits of a flat batch within 1e-4; greedy tokens of a batch of mixed lengths,
    prefilled in chunks of 16 beside decode rows, equal to transformers'."""
    model_dir, hf = tiny_deepseek(kind)
    assert_chunked_batch_matches(model_dir, hf, backend, _prompts(1, 9, 37, 20, 3), kind)


def test_rope_on_halves_matches_transformers(tiny_deepseek):
    """DeepSeek-V3 with rope_interleave false rotates the two halves of the rope dims, not pairs."""
    model_dir, hf = tiny_deepseek("v3_halves")
    model = LLM(model=model_dir).llm_engine.model
    prompts = _prompts(30, 7)
    with torch.no_grad():
        want = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(prompt_forward(model, prompts), want, atol=1e-4, rtol=0)


def test_kv_cache_holds_one_latent_per_token(tiny_deepseek):
    """A token costs (kv_lora_rank + qk_rope_head_dim) values per layer, in one tensor that is the
    layer's K and V alike: the budget buys blocks at that price."""
    model_dir, _ = tiny_deepseek("v3")
    per_block = 3 * 16 * LATENT * 4  # layers x block_size x latent x float32
    llm = LLM(model=model_dir, kv_cache_memory=50 * per_block + per_block // 2)
    engine = llm.llm_engine
    assert engine.num_blocks == 50
    for k, v in engine.runner.kv_caches:
        assert k is v and tuple(k.shape) == (50, 16, 1, LATENT)


def test_sleep_and_wake_up_keep_one_latent_tensor(tiny_deepseek):
    """After sleep (level 1) the KV cache wakes as it was built: each layer's K and V one latent tensor
    (two separate ones would leave the values the kernels read unwritten), and tokens unchanged."""
    model_dir, _ = tiny_deepseek("v3")
    llm = LLM(model=model_dir, enable_sleep_mode=True, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts(9, 30)]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.sleep(level=1)
    llm.wake_up()
    assert all(k is v for k, v in llm.llm_engine.runner.kv_caches)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == before


def test_prefix_cache_and_preemption_keep_tokens(tiny_deepseek):
    """A prefix-cache hit skips the shared blocks and changes no token; sequences preempted for
    want of blocks are recomputed to transformers' tokens."""
    model_dir, hf = tiny_deepseek("v3")
    assert_prefix_hit_keeps_tokens(model_dir, hf, _prompts(48)[0], _prompts(11, 20))

    per_block = 3 * 4 * LATENT * 4
    llm = LLM(model=model_dir, block_size=4, kv_cache_memory=16 * per_block, max_num_seqs=4)
    prompts = _prompts(5, 7)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False)  # fmt: skip
    assert llm.llm_engine.scheduler.stats.num_preemptions > 0
    for p, out in zip(prompts, outs):
        assert_greedy_matches(out.outputs[0].token_ids, *hf_greedy(hf, p, 30), "preempted")
    assert_no_leaks(llm)


def test_mtp_layer_is_skipped(tiny_deepseek, tmp_path):
    """DeepSeek-V3 checkpoints carry a multi-token-prediction layer after the last one
    (``model.layers.<num_hidden_layers>``): it loads without it, as transformers does."""
    model_dir, hf = tiny_deepseek("v3")
    out = shutil.copytree(model_dir, tmp_path / "mtp")
    tensors = load_file(out / "model.safetensors")
    tensors.update({"model.layers.3.eh_proj.weight": torch.zeros(64, 128),
                    "model.layers.3.enorm.weight": torch.ones(64),
                    "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": torch.zeros(LATENT, 64)})  # fmt: skip
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    model = LLM(model=str(out)).llm_engine.model
    prompts = _prompts(12)
    with torch.no_grad():
        want = hf(torch.tensor(prompts)).logits[:, -1]
    torch.testing.assert_close(prompt_forward(model, prompts), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize(("field", "value"), [("topk_method", "random"), ("scoring_func", "tanh")])
def test_unbuilt_routing_is_refused_by_name(tiny_deepseek, tmp_path, field, value):
    model_dir, _ = tiny_deepseek("v3")
    out = shutil.copytree(model_dir, tmp_path / "bad")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=f"{field} {value!r} is not supported"):
        LLM(model=str(out))


def test_lora_is_refused_by_name(tiny_deepseek):
    model_dir, _ = tiny_deepseek("v2lite")
    with pytest.raises(ValueError, match="LoRA adapters are not supported for DeepseekV2ForCausalLM"):
        LLM(model=model_dir, enable_lora=True)


def test_router_stays_float32_in_bfloat16():
    """transformers keeps the router's weight and correction bias in float32 (a bfloat16 bias would
    move expert choices); so does the model after ``.to(bfloat16)``, its experts in bfloat16."""
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(tiny_config("v3")).to(torch.bfloat16)
    moe = model.model.layers[1].mlp
    assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == torch.float32
    assert moe.experts.w13.dtype == model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.bfloat16


def test_v3_block_fp8_checkpoint_loads_as_its_dense_values(tiny_deepseek, tmp_path):
    """DeepSeek-V3 / R1 ship block-FP8 weights (``weight_scale_inv`` per 128 x 128 tile; here 16 x 16, the
    latent projections' 40 rows ending in a partial tile): every projection, the absorbed ``kv_b_proj``
    and the experts included, loads as its dense value; the router (``mlp.gate``) and its bias stay as
    they are; greedy tokens and logprobs equal transformers' on the dense twin."""
    model_dir, _ = tiny_deepseek("v3")
    weights = _write_fp8(shutil.copytree(model_dir, tmp_path / "dense"), tmp_path / "fp8", _block_fp8((16, 16)),
                         "block", (16, 16))  # fmt: skip
    fp8 = load_file(tmp_path / "fp8" / "model.safetensors")
    assert fp8["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.float8_e4m3fn
    assert fp8["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert any(k.startswith("model.layers.1.mlp.experts.") and v.dtype == torch.float8_e4m3fn for k, v in fp8.items())
    want = _dense_copy(tmp_path / "dense", weights, tmp_path / "want")
    _assert_same_parameters(tmp_path / "fp8", want)
    hf = AutoModelForCausalLM.from_pretrained(want, dtype=torch.float32)
    llm = LLM(model=str(tmp_path / "fp8"), max_num_seqs=4, max_num_batched_tokens=16)
    assert_engine_matches_transformers(llm, hf, _prompts(6, 23), "deepseek-v3 fp8")


def test_top1_router_renormalises_as_transformers():
    """With ``norm_topk_prob`` a top-1 router's weight is renormalised to one (then scaled), as
    transformers' and vLLM's routers do (DeepSeek's own code skipped it at top_k 1)."""
    torch.manual_seed(0)
    config = tiny_config("v3")
    config.num_experts_per_tok = 1
    hf_gate = AutoModelForCausalLM.from_config(config).model.layers[1].mlp.gate
    moe = DeepseekV3ForCausalLM(config).model.layers[1].mlp
    with torch.no_grad():
        hf_gate.weight.normal_(0.0, 0.3)
        hf_gate.e_score_correction_bias.normal_(0.0, 0.3)
        moe.gate.weight.copy_(hf_gate.weight)
        moe.gate.e_score_correction_bias.copy_(hf_gate.e_score_correction_bias)
        x = torch.randn(7, 64)
        ids, weights = moe.route(x)
        _, want_weights, want_ids = hf_gate(x)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights.to(weights.dtype))
    assert torch.allclose(weights, torch.full_like(weights, 2.5))
