"""GLM-4.5 / 4.6 (``Glm4MoeForCausalLM``) and GLM-4-0414 / GLM-Z1 (``Glm4ForCausalLM``) through the
whole engine, equal to transformers on tiny random checkpoints it saved."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Glm4Config, Glm4MoeConfig

from helpers import (hf_greedy_logprobs, hf_last_logits, prompt_forward, random_models,
                     seeded_prompts)  # fmt: skip
from test_architectures import assert_chunked_batch_matches, assert_prefix_hit_keeps_tokens
from test_engine import assert_no_leaks
from vllmini import LLM, SamplingParams

_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-5,
              tie_word_embeddings=False, pad_token_id=0, eos_token_id=2)  # fmt: skip


def tiny_config(kind: str, **overrides):
    """``moe``: GLM-4.5's shape: q/k/v biases, per-head q/k norm, rope on half of each 24-wide head,
    a dense first layer, then 8 experts in 4 groups (top 2 of the best 2 groups), a shared expert,
    renormalised and scaled by 2.5, one MTP layer declared; ``dense``: GLM-4-0414's, heads 16 wide."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    if kind == "moe":
        features = dict(head_dim=24, attention_bias=True, use_qk_norm=True, moe_intermediate_size=32,
                        n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, n_shared_experts=1,
                        first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                        num_nextn_predict_layers=1)  # fmt: skip
        return Glm4MoeConfig(**_SHAPE, **features, rope_parameters=rope, architectures=["Glm4MoeForCausalLM"],
                             **overrides)  # fmt: skip
    return Glm4Config(**_SHAPE, head_dim=16, attention_bias=True, rope_parameters=rope,
                      architectures=["Glm4ForCausalLM"], **overrides)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_glm(tmp_path_factory, default_model_dir):
    return random_models(tiny_config, tmp_path_factory, default_model_dir)


_prompts = seeded_prompts


@pytest.mark.parametrize(("kind", "backend"), [("moe", "cpu"), ("moe", "torch"), ("dense", "cpu")])
def test_greedy_and_logits_match_transformers(tiny_glm, kind, backend):
    """Last-position logits of a flat batch within 1e-4; greedy tokens of a batch of mixed lengths,
    prefilled in chunks of 16 beside decode rows, equal to transformers'."""
    model_dir, hf = tiny_glm(kind)
    assert_chunked_batch_matches(model_dir, hf, backend, _prompts(1, 9, 37, 20, 3), f"glm {kind}")


def test_prefix_cache_hit_keeps_tokens(tiny_glm):
    """A prefix-cache hit skips the shared blocks and changes no token."""
    model_dir, hf = tiny_glm("moe")
    assert_prefix_hit_keeps_tokens(model_dir, hf, _prompts(48)[0], _prompts(11, 20))


def test_mtp_layer_is_skipped(tiny_glm, tmp_path):
    """GLM-4.5 checkpoints carry ``num_nextn_predict_layers`` MTP layers after the last one
    (``model.layers.<num_hidden_layers>``: its projections, norms and a whole MoE layer): the model
    loads without them, as transformers does."""
    model_dir, hf = tiny_glm("moe")
    out = shutil.copytree(model_dir, tmp_path / "mtp")
    tensors = load_file(out / "model.safetensors")
    mtp = {name.replace("model.layers.1.", "model.layers.3."): t.clone() for name, t in tensors.items()
           if name.startswith("model.layers.1.")}  # fmt: skip
    mtp.update({"model.layers.3.eh_proj.weight": torch.zeros(64, 128), "model.layers.3.enorm.weight": torch.ones(64),
                "model.layers.3.hnorm.weight": torch.ones(64), "model.layers.3.shared_head.norm.weight": torch.ones(64),
                "model.layers.3.shared_head.head.weight": torch.zeros(512, 64)})  # fmt: skip
    assert "model.layers.3.mlp.gate.e_score_correction_bias" in mtp
    save_file({**tensors, **mtp}, out / "model.safetensors", metadata={"format": "pt"})
    model = LLM(model=str(out)).llm_engine.model
    prompts = _prompts(12)
    torch.testing.assert_close(prompt_forward(model, prompts), hf_last_logits(hf, prompts), atol=1e-4, rtol=0)


def test_dense_checkpoint_names_fused_mlp(tiny_glm, tmp_path):
    """GLM-4-0414 checkpoints hold ``mlp.gate_up_proj`` fused: one missing is named so, not as gate/up halves."""
    model_dir, _ = tiny_glm("dense")
    out = shutil.copytree(model_dir, tmp_path / "partial")
    tensors = load_file(out / "model.safetensors")
    assert "model.layers.0.mlp.gate_up_proj.weight" in tensors and "model.layers.0.mlp.gate_proj.weight" not in tensors
    del tensors["model.layers.2.mlp.gate_up_proj.weight"]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.2.mlp.gate_up_proj.weight"):
        LLM(model=str(out))


@pytest.mark.parametrize(("field", "value", "message"), [
    ("hidden_act", "gelu_pytorch_tanh", "hidden_act 'gelu_pytorch_tanh' is not supported"),
    ("n_group", 3, "n_group=3 must divide n_routed_experts=8"),
])  # fmt: skip
def test_unbuilt_config_is_refused_by_name(tiny_glm, tmp_path, field, value, message):
    model_dir, _ = tiny_glm("moe")
    out = shutil.copytree(model_dir, tmp_path / "bad")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=message):
        LLM(model=str(out))


def test_mtp_speculation_is_refused_by_name(tiny_glm):
    """The MTP layers are skipped, not run: speculating with them is refused by the method's name."""
    model_dir, _ = tiny_glm("moe")
    with pytest.raises(ValueError, match="speculative_config.method must be one of"):
        LLM(model=model_dir, speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_lora_adapter_on_fused_gate_up_matches_peft(tiny_glm, tmp_path):
    """A PEFT adapter of GLM-4-0414 targets the checkpoint's fused ``mlp.gate_up_proj`` (and q/v/o):
    greedy tokens and logprobs equal transformers + PEFT's."""
    peft = pytest.importorskip("peft")
    from helpers import save_tiny_lora
    from vllmini import LoRARequest

    model_dir, _ = tiny_glm("dense")
    adapter = save_tiny_lora(model_dir, tmp_path / "a1", 1, r=4, target_modules=["q_proj", "v_proj", "o_proj",
                                                                                  "gate_up_proj", "down_proj"])  # fmt: skip
    oracle = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter).eval()
    llm = LLM(model=model_dir, enable_lora=True, max_lora_rank=8)
    prompts = _prompts(9, 21)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=LoRARequest("a1", 1, adapter))  # fmt: skip
    for p, out in zip(prompts, outs):
        want = hf_greedy_logprobs(oracle, p, 8)
        got = out.outputs[0]
        assert got.token_ids == want[0]
        ours = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(want[1]), atol=2e-4, rtol=0)
    assert_no_leaks(llm)
