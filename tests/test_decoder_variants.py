"""Granite 3 (dense and MoE), OLMo 2 / OLMo 3, EXAONE 4.0 and ERNIE 4.5 (models/granite.py, olmo2.py,
exaone4.py, ernie45.py) against transformers on the same random weights: last-position logits of a flat batch within 1e-4, and through the engine
(chunked prefill, prefix-cache hits, OLMo 3's and EXAONE 4's sliding layers) greedy tokens equal and logprobs close."""
from __future__ import annotations

import pytest
import torch
from transformers import (AutoModelForCausalLM, Ernie4_5Config, Exaone4Config, GraniteConfig, GraniteMoeConfig, Olmo2Config,
                          Olmo3Config)  # fmt: skip
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm as HFOlmo2RMSNorm

from helpers import (assert_engine_matches_transformers, hf_last_logits, prompt_forward, randomize_biases,
                     randomize_norms, save_tiny_model)  # fmt: skip
from test_engine import assert_no_leaks
from vllmini import LLM, SamplingParams
from vllmini.models.layers import RMSNorm
from vllmini.models.olmo2 import Olmo2RMSNorm
from vllmini.models.weight_loader import load_model

_SHAPE = dict(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.05, tie_word_embeddings=False,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip


def granite_config() -> GraniteConfig:
    """Every multiplier away from 1 (Granite 3.x: 12, 0.0078, 0.22, 8), attention biases on."""
    return GraniteConfig(**_SHAPE, architectures=["GraniteForCausalLM"], embedding_multiplier=6.0,
                         attention_multiplier=0.05, residual_multiplier=0.4, logits_scaling=3.0, attention_bias=True,
                         rope_theta=10000.0)  # fmt: skip


def granitemoe_config() -> GraniteMoeConfig:
    """Granite's multipliers, 6 experts of width 48, top 2."""
    multipliers = dict(embedding_multiplier=6.0, attention_multiplier=0.05, residual_multiplier=0.4, logits_scaling=3.0)
    return GraniteMoeConfig(**{**_SHAPE, "intermediate_size": 48}, architectures=["GraniteMoeForCausalLM"],
                            num_local_experts=6, num_experts_per_tok=2, **multipliers)  # fmt: skip


def olmo2_config() -> Olmo2Config:
    return Olmo2Config(**_SHAPE, architectures=["Olmo2ForCausalLM"], rope_theta=500000.0)


def olmo3_config() -> Olmo3Config:
    """Layers 0-2 slide over 12 tokens, layer 3 sees all; the full layer's rope is scaled, the
    sliding ones' is not (one rope_parameters set per layer type)."""
    ropes = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
             "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0}}  # fmt: skip
    return Olmo3Config(**_SHAPE, architectures=["Olmo3ForCausalLM"], sliding_window=12, rope_parameters=ropes)


def exaone4_config() -> Exaone4Config:
    """EXAONE-4.0-32B's hybrid: 3 sliding layers with RoPE, then a global one without (NoPE)."""
    return Exaone4Config(**_SHAPE, architectures=["Exaone4ForCausalLM"], sliding_window=12, sliding_window_pattern=4)


def exaone4_global_config() -> Exaone4Config:
    """EXAONE-4.0-1.2B's form: no sliding window, every layer global with RoPE."""
    return Exaone4Config(**_SHAPE, architectures=["Exaone4ForCausalLM"], sliding_window=None,
                         layer_types=["full_attention"] * 4)  # fmt: skip


def ernie45_config() -> Ernie4_5Config:
    """Biases on every projection (use_bias), tied embeddings as ERNIE-4.5-0.3B."""
    return Ernie4_5Config(**{**_SHAPE, "tie_word_embeddings": True}, architectures=["Ernie4_5ForCausalLM"],
                          use_bias=True)  # fmt: skip


CONFIGS = {"granite": granite_config, "granitemoe": granitemoe_config, "olmo2": olmo2_config, "olmo3": olmo3_config,
           "exaone4": exaone4_config, "exaone4-global": exaone4_global_config, "ernie45": ernie45_config}  # fmt: skip
# the layers that slide over 12 tokens, and those without RoPE
WINDOWS = {"olmo3": [12, 12, 12, None], "exaone4": [12, 12, 12, None]}
NOPE = {"exaone4": [False, False, False, True]}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory, default_model_dir):
    """(name, transformers' model, its saved directory) with random norms and biases."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIGS[request.param]())
    hf = randomize_biases(randomize_norms(hf, std=0.3), std=0.1).eval()
    return request.param, hf, save_tiny_model(hf, tmp_path_factory.mktemp(request.param), default_model_dir)


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 4000, (n,), generator=g).tolist() for n in lengths]


def test_logits_match_transformers(pair):
    name, hf, model_dir = pair
    ours, _ = load_model(model_dir, torch.float32, torch.device("cpu"))
    assert type(ours).__name__ == hf.config.architectures[0]
    windows = [layer.self_attn.attn.window for layer in ours.model.layers]
    assert windows == WINDOWS.get(name, [None] * 4)
    assert [not layer.self_attn.use_rope for layer in ours.model.layers] == NOPE.get(name, [False] * 4)
    prompts = _prompts([1, 7, 30, 45], seed=1)
    logits = prompt_forward(ours, prompts)
    trained = type(ours)(hf.config)  # a trainer's state_dict (transformers' in-memory names) fills every parameter
    assert trained.load_weights(hf.state_dict().items()) == {n for n, _ in trained.named_parameters()}
    torch.testing.assert_close(prompt_forward(trained.eval(), prompts), logits, atol=0, rtol=0)
    torch.testing.assert_close(logits, hf_last_logits(hf, prompts), atol=1e-4, rtol=0)


def test_engine_greedy_and_logprobs_match_transformers(pair):
    """Chunks of 16 tokens, a prefix-cache hit, sequences several of OLMo 3's windows long."""
    name, hf, model_dir = pair
    llm = LLM(model=str(model_dir), max_num_batched_tokens=16, enable_prefix_caching=True)
    windows = set(llm.llm_engine.model.layer_windows)  # sliding and full layers mixed: KV groups (test_hybrid_kv.py)
    assert (llm.llm_engine.block_manager.num_groups > 1) == (len(windows) > 1) == (name in ("olmo3", "exaone4")), windows
    prompts = _prompts([3, 40, 29], seed=2)
    prompts.append(prompts[1][:32] + prompts[2][:5])
    assert_engine_matches_transformers(llm, hf, prompts, f"{name}")
    assert_no_leaks(llm)


@pytest.mark.parametrize("pair", ["granite"], indirect=True)
def test_granite_scales_prompt_embeds_as_token_ids(pair):
    """transformers and vLLM multiply whatever input embeddings they get by embedding_multiplier:
    the table's rows given as prompt_embeds generate what their token ids do."""
    _, hf, model_dir = pair
    llm = LLM(model=str(model_dir), enable_prompt_embeds=True)
    ids = _prompts([9], seed=3)[0]
    embeds = hf.get_input_embeddings()(torch.tensor(ids)).detach()
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    by_ids, by_embeds = llm.generate([{"prompt_token_ids": ids}, {"prompt_embeds": embeds}], greedy, use_tqdm=False)
    assert by_embeds.outputs[0].token_ids == by_ids.outputs[0].token_ids


def test_granite_moe_names_a_missing_expert_tensor_as_its_checkpoint_does(pair_dir_granitemoe):
    """An incomplete checkpoint is refused naming the tensor in the checkpoint's own terms."""
    from safetensors.torch import load_file, save_file

    path = pair_dir_granitemoe / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.block_sparse_moe.output_linear.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.block_sparse_moe\.output_linear\.weight"):
        load_model(pair_dir_granitemoe, torch.float32, torch.device("cpu"))


@pytest.fixture
def pair_dir_granitemoe(tmp_path, default_model_dir):
    torch.manual_seed(0)
    return save_tiny_model(AutoModelForCausalLM.from_config(granitemoe_config()), tmp_path, default_model_dir)


def test_olmo2_norm_scales_in_float32_as_transformers():
    """OLMo's RMSNorm multiplies the weight into the float32 values before the cast: in bfloat16
    its outputs equal transformers' bit for bit, where Llama's order (cast, then scale) does not."""
    torch.manual_seed(0)
    x, weight = torch.randn(64, 96).bfloat16(), torch.randn(96).bfloat16()
    ref, ours, llama = HFOlmo2RMSNorm(96, 1e-6), Olmo2RMSNorm(96, 1e-6), RMSNorm(96, 1e-6)
    for norm in (ref, ours, llama):
        norm.weight.data = weight.clone()
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))
        assert not torch.equal(llama(x), ref(x))
