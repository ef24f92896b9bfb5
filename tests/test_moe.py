"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral) through the whole engine, equal to
transformers on the same checkpoint; the experts layer against a per-token reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from helpers import (prompt_forward, randomize_biases, save_tiny_lora, save_tiny_model, tiny_mixtral_config,
                     tiny_qwen2_moe_config, tiny_qwen3_moe_config)  # fmt: skip
from test_architectures import assert_engine_greedy
from vllmini import LLM, LoRARequest, SamplingParams
from vllmini.models import moe
from vllmini.models.moe import FusedMoE

MAKERS = {"qwen3_moe": tiny_qwen3_moe_config, "qwen2_moe": tiny_qwen2_moe_config, "mixtral": tiny_mixtral_config}


@pytest.fixture(scope="module", params=sorted(MAKERS))
def tiny_moe(request, tmp_path_factory, default_model_dir):
    """(folder, transformers model) of a tiny random MoE checkpoint saved by transformers."""
    torch.manual_seed(0)
    config = MAKERS[request.param](vocab_size=49152, initializer_range=0.05)
    hf = randomize_biases(AutoModelForCausalLM.from_config(config), std=0.1).eval()
    return str(save_tiny_model(hf, tmp_path_factory.mktemp(request.param), default_model_dir)), hf


def test_greedy_and_logits_match_transformers(tiny_moe):
    """Greedy tokens of a batch (prefilled in chunks of 16, so prefill and decode rows share
    steps) equal transformers'; last-position logits of a flat batch within 1e-4."""
    model_dir, hf = tiny_moe
    llm = LLM(model=model_dir, max_num_batched_tokens=16, max_num_seqs=4)
    model = llm.llm_engine.model
    assert type(model).__name__ == hf.config.architectures[0]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 4000, (n,), generator=g).tolist() for n in (1, 9, 37, 20, 3)]
    with torch.no_grad():
        want = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(prompt_forward(model, prompts), want, atol=1e-4, rtol=0)
    assert_engine_greedy(llm, hf, prompts, 16, hf.config.architectures[0])


def test_seeded_sampling_is_the_same_alone_and_batched(tiny_moe):
    """A token's experts depend on that token alone: a seeded request gives the same tokens
    whatever else shares its steps."""
    model_dir, _ = tiny_moe
    llm = LLM(model=model_dir, max_num_batched_tokens=24)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(500, 530))}
    alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": list(range(900 + i, 940 + 3 * i))} for i in range(4)]
    batched = llm.generate([*others, prompt], params, use_tqdm=False)[-1].outputs[0].token_ids
    assert alone == batched


def _reference_moe(layer: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    """The definition, one token at a time: softmax over the router logits, top-k, (renormalise),
    the weighted sum of those experts' gated MLPs."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(layer.gate(x[t]).float(), -1)
        weights, ids = probs.topk(layer.top_k)
        if layer.renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights.tolist(), ids.tolist()):
            gate, up = (layer.experts.w13[e] @ x[t]).chunk(2)
            out[t] += w * (layer.experts.w2[e] @ (F.silu(gate) * up))
    return out


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 40), num_experts=st.integers(1, 9), data=st.data(), grouped=st.booleans(),
       renormalize=st.booleans())  # fmt: skip
def test_fused_moe_is_its_definition(tokens, num_experts, data, grouped, renormalize):
    """Any batch size (tokens piling on one expert, experts left idle), top-k and expert count,
    through the grouped matmul and through the per-expert loop it falls back to."""
    top_k = data.draw(st.integers(1, num_experts))
    torch.manual_seed(data.draw(st.integers(0, 2**16)))
    layer = FusedMoE(16, 12, num_experts, top_k, renormalize)
    for p in (layer.gate.weight, layer.experts.w13, layer.experts.w2):
        p.data.normal_(0, 0.5)
    x = torch.randn(tokens, 16)
    supported = moe.grouped_mm_supported
    try:
        moe.grouped_mm_supported = lambda device, dtype: grouped and supported(device, dtype)
        got = layer(x)
    finally:
        moe.grouped_mm_supported = supported
    torch.testing.assert_close(got, _reference_moe(layer, x), atol=1e-5, rtol=1e-5)


def test_bad_configs_and_checkpoints_are_refused(tmp_path, default_model_dir):
    """A checkpoint missing one expert's tensor names it; top-k above the expert count is refused."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_mixtral_config(vocab_size=49152)).eval()
    save_tiny_model(hf, tmp_path, default_model_dir)
    tensors = load_file(tmp_path / "model.safetensors")
    gone = "model.layers.2.block_sparse_moe.experts.3.w3.weight"
    save_file({k: v for k, v in tensors.items() if k != gone}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=gone.replace(".", r"\.")):
        LLM(model=str(tmp_path))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        FusedMoE(16, 12, 4, 5, True)


def test_lora_matches_peft_and_expert_targets_are_refused(tmp_path, default_model_dir):
    """An adapter on the attention projections of a Qwen3-MoE gives PEFT's greedy tokens beside
    the base model; PEFT's adapter on every projection (it adapts the stacked experts too) fails
    that request alone, naming the experts."""
    import peft

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_qwen3_moe_config(vocab_size=49152, initializer_range=0.05)).eval()
    model_dir = save_tiny_model(hf, tmp_path / "base", default_model_dir)
    adapter = save_tiny_lora(model_dir, tmp_path / "attn", seed=1, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    llm = LLM(model=str(model_dir), enable_lora=True, max_loras=2)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompt = list(range(300, 330))
    base, adapted = llm.generate([{"prompt_token_ids": prompt}] * 2, params,
                                 lora_request=[None, LoRARequest("attn", 1, adapter)], use_tqdm=False)  # fmt: skip
    oracle = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter).eval()
    with torch.no_grad():
        want = oracle.generate(input_ids=torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt) :].tolist()  # fmt: skip
    assert adapted.outputs[0].token_ids == want != base.outputs[0].token_ids

    experts = save_tiny_lora(model_dir, tmp_path / "all", seed=2)  # LORA_TARGETS: the MLP's projections too
    assert any(".mlp.experts." in k for k in load_file(f"{experts}/adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"target_parameters=.*mixture of experts"):
        llm.generate([{"prompt_token_ids": prompt}], params, lora_request=LoRARequest("all", 2, experts), use_tqdm=False)
    assert llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids == \
        base.outputs[0].token_ids
