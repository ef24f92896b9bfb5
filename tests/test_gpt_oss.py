"""gpt-oss (models/gpt_oss.py) against transformers' GptOssForCausalLM on the same random weights:
the MoE block alone, last-position logits of a flat batch, and greedy tokens and logprobs through the
engine (chunked prefill, prefix-cache hits, the sliding and full layers in separate KV groups, both
CPU attention backends); the checkpoint's MXFP4 experts dequantized as transformers does."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

from helpers import assert_engine_matches_transformers, hf_last_logits, prompt_forward, save_tiny_model
from test_engine import assert_no_leaks
from vllmini import LLM
from vllmini.models.gpt_oss import GptOssMoE, _our_expert_layout
from vllmini.models.mxfp4 import dequantize_mxfp4
from vllmini.models.weight_loader import load_model

WINDOW = 12


def gpt_oss_config(**overrides) -> GptOssConfig:
    """gpt-oss-20b's form, shrunk: layers alternating sliding (12 tokens) and full, 6 experts top 2, YaRN
    over a short original context; swiglu_limit low enough that the clamps bite on these weights."""
    rope = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 64, "rope_theta": 150000.0}  # fmt: skip
    config = GptOssConfig(**{
        "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 6,
        "num_experts_per_tok": 2, "sliding_window": WINDOW, "max_position_embeddings": 512,
        "rope_parameters": rope, "swiglu_limit": 1.5, "initializer_range": 0.05, "tie_word_embeddings": False,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "architectures": ["GptOssForCausalLM"],
        "layer_types": ["sliding_attention", "full_attention"] * 2, **overrides,
    })  # fmt: skip
    config._attn_implementation = "eager"  # (transformers' sinks: its eager attention)
    return config


def randomize(hf):
    """transformers initialises biases and sinks to zero and norms to one: random, so that a bias, a
    sink or a norm that is never loaded (or applied wrongly) shows; the experts wider than their init."""
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(("bias", "sinks")):
                param.normal_(0.0, 0.5 if name.endswith("sinks") else 0.1)
            elif "norm" in name:
                param.normal_(1.0, 0.3)
            elif "experts." in name:
                param.normal_(0.0, 0.3)
    return hf


@pytest.fixture(scope="module")
def pair(tmp_path_factory, default_model_dir):
    torch.manual_seed(0)
    hf = randomize(AutoModelForCausalLM.from_config(gpt_oss_config())).eval()
    return hf, save_tiny_model(hf, tmp_path_factory.mktemp("gpt_oss"), default_model_dir)


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 4000, (n,), generator=g).tolist() for n in lengths]


def test_moe_block_matches_transformers():
    """Router (with its bias), top-k softmax, biased experts, the clamped SwiGLU, interleaved gate/up
    read gate first: transformers' GptOssMLP on the same weights, hit and missed experts alike."""
    torch.manual_seed(0)
    config = gpt_oss_config()
    ref = randomize(GptOssMLP(config))
    ours = GptOssMoE(config)
    prefix = "model.layers.0.mlp."
    named = ((prefix + n, t.detach()) for n, t in ref.state_dict().items())
    for name, tensor in _our_expert_layout(named):
        ours.get_parameter(name.removeprefix(prefix)).data.copy_(tensor)
    x = torch.randn(40, config.hidden_size)
    with torch.no_grad():
        expected, _ = ref(x[None])
        torch.testing.assert_close(ours(x), expected[0], atol=1e-5, rtol=1e-5)
        gate_up = x @ ref.experts.gate_up_proj[0] + ref.experts.gate_up_proj_bias[0]
        assert (gate_up[..., ::2] > config.swiglu_limit).any() and (gate_up[..., 1::2].abs() > config.swiglu_limit).any()


def test_logits_match_transformers(pair):
    hf, model_dir = pair
    ours, _ = load_model(model_dir, torch.float32, torch.device("cpu"))
    assert ours.layer_windows == [WINDOW, None, WINDOW, None] and ours.attention_sinks
    prompts = _prompts([1, 7, 30, 45], seed=1)
    logits = prompt_forward(ours, prompts)
    torch.testing.assert_close(logits, hf_last_logits(hf, prompts), atol=1e-4, rtol=0)
    without_sinks = type(ours)(hf.config)  # the same weights, sinks at -inf: the logits move
    without_sinks.load_weights(hf.state_dict().items())
    for layer in without_sinks.model.layers:
        layer.self_attn.sinks.data.fill_(-float("inf"))
    assert not torch.allclose(prompt_forward(without_sinks.eval(), prompts), logits, atol=1e-2)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_engine_greedy_and_logprobs_match_transformers(pair, backend):
    """Chunks of 16 tokens, a prefix-cache hit, prompts several windows long; sliding and full layers
    in their own KV groups."""
    hf, model_dir = pair
    llm = LLM(model=str(model_dir), max_num_batched_tokens=16, enable_prefix_caching=True, attention_backend=backend)
    assert llm.llm_engine.block_manager.num_groups == 2
    prompts = _prompts([3, 40, 29], seed=2)
    prompts.append(prompts[1][:32] + prompts[2][:5])
    assert_engine_matches_transformers(llm, hf, prompts, "gpt-oss")
    assert_no_leaks(llm)


def _mxfp4_checkpoint(model_dir, out_dir) -> dict[str, torch.Tensor]:
    """``model_dir``'s checkpoint with its experts' weights replaced by random MXFP4 blocks and scales,
    saved as OpenAI publishes gpt-oss (quantization_config mxfp4); returns the packed tensors."""
    g = torch.Generator().manual_seed(5)
    tensors, packed = load_file(model_dir / "model.safetensors"), {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inner, outer = tensors.pop(name).shape  # [E, in, out]: packed as [E, out, in / 32, 16]
        packed[name + "_blocks"] = torch.randint(0, 256, (experts, outer, inner // 32, 16), generator=g, dtype=torch.uint8)
        packed[name + "_scales"] = torch.randint(124, 129, (experts, outer, inner // 32), generator=g, dtype=torch.uint8)
    save_file({**tensors, **packed}, out_dir / "model.safetensors", metadata={"format": "pt"})
    for name in [p.name for p in model_dir.iterdir() if p.name != "model.safetensors"]:
        (out_dir / name).write_bytes((model_dir / name).read_bytes())
    config = json.loads((out_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip
    (out_dir / "config.json").write_text(json.dumps(config))
    return packed


def test_mxfp4_experts_dequantize_as_transformers_does(pair, tmp_path):
    """OpenAI's MXFP4 experts: each weight equals transformers' dequantization of the same blocks and
    scales, exactly, and logits, greedy tokens and logprobs equal transformers' own MXFP4 load's
    (``Mxfp4Config(dequantize=True)``, its CPU path)."""
    hf, model_dir = pair
    packed = _mxfp4_checkpoint(model_dir, tmp_path)
    ours, _ = load_model(tmp_path, torch.float32, torch.device("cpu"))
    for layer in range(4):
        prefix = f"model.layers.{layer}.mlp.experts."
        gate_up = convert_moe_packed_tensors(packed[prefix + "gate_up_proj_blocks"], packed[prefix + "gate_up_proj_scales"],
                                             dtype=torch.float32)  # [E, H, 2I], interleaved  # fmt: skip
        down = convert_moe_packed_tensors(packed[prefix + "down_proj_blocks"], packed[prefix + "down_proj_scales"],
                                          dtype=torch.float32)  # [E, I, H]  # fmt: skip
        experts = ours.model.layers[layer].mlp.experts
        assert torch.equal(experts.w13, torch.cat((gate_up[..., ::2], gate_up[..., 1::2]), -1).transpose(1, 2))
        assert torch.equal(experts.w2, down.transpose(1, 2))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager",
                                                  quantization_config=Mxfp4Config(dequantize=True)).eval()  # fmt: skip
    prompts = _prompts([5, 33], seed=3)
    torch.testing.assert_close(prompt_forward(ours, prompts), hf_last_logits(theirs, prompts), atol=1e-4, rtol=0)
    llm = LLM(model=str(tmp_path), max_num_batched_tokens=16)
    assert_engine_matches_transformers(llm, theirs, prompts, "gpt-oss MXFP4")
    llm.collective_rpc("reload_weights")  # (vLLM's live reload reads the MXFP4 folder as the first load)
    assert_engine_matches_transformers(llm, theirs, prompts, "gpt-oss MXFP4 reloaded")


def test_dequantize_mxfp4_matches_transformers_and_refuses_bad_shapes():
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 255, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.arange(255, dtype=torch.uint8)[None, :, None].expand(3, 255, 2).contiguous()  # every finite scale
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # (transposed to [E, in, out])
        assert torch.equal(dequantize_mxfp4(blocks, scales, dtype), ref.transpose(1, 2))
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[:, :4])
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.int(), scales)


def test_mxfp4_refusals(pair, tmp_path):
    """A scale without its blocks is named; MXFP4 is read for gpt-oss only."""
    _, model_dir = pair
    _mxfp4_checkpoint(model_dir, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.down_proj_blocks"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.down_proj_scales"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="quant_method 'mxfp4'"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))
