"""Llama 4 (Llama4ForCausalLM, and Scout / Maverick's Llama4ForConditionalGeneration served text-only)
against transformers 5.25: interleaved rope with llama3 scaling in the RoPE layers, the weightless
q/k norm, the attention temperature of the NoPE layers (floor_scale 4: it changes every 4 positions),
sigmoid top-k experts fed the scaled token plus the shared expert, dense layers between them; and
max_model_len capped at attention_chunk_size (chunked local attention is not built)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers as T
from safetensors.torch import load_file

from helpers import TOKENIZER_FILES, random_models, seeded_prompts
from test_architectures import assert_chunked_batch_matches, assert_prefix_hit_keeps_tokens
from vllmini import LLM

KV = 64 << 20

_TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
             initializer_range=0.2, rms_norm_eps=1e-5, num_local_experts=4, no_rope_layer_interval=2,
             attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5, attention_chunk_size=128,
             pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)  # fmt: skip
_LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip


def tiny_config(kind: str):
    """``scout``: experts in every layer (top 1), q/k norm, llama3 rope; ``maverick``: experts every second
    layer (top 2 here), dense layers between, no q/k norm. Layers alternate RoPE, NoPE (no_rope_layer_interval 2)."""
    if kind == "scout":
        return T.Llama4TextConfig(**_TEXT, num_experts_per_tok=1, use_qk_norm=True, rope_parameters=_LLAMA3,
                                  architectures=["Llama4ForCausalLM"])  # fmt: skip
    if kind == "maverick":
        return T.Llama4TextConfig(**_TEXT, num_experts_per_tok=2, interleave_moe_layer_step=2, use_qk_norm=False,
                                  rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                                  architectures=["Llama4ForCausalLM"])  # fmt: skip
    raise KeyError(kind)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    return random_models(tiny_config, tmp_path_factory, default_model_dir)


@pytest.mark.parametrize(("kind", "backend"), [("scout", "cpu"), ("scout", "torch"), ("maverick", "cpu"),
                                                   ("maverick", "torch")])
def test_greedy_and_logits_match_transformers(tiny, kind, backend):
    """Last-position logits of a flat batch within 1e-4; greedy tokens of a batch of mixed lengths (past 40
    positions: the NoPE layers' temperature changes every 4), prefilled in chunks of 16 beside decodes."""
    model_dir, hf = tiny(kind)
    assert_chunked_batch_matches(model_dir, hf, backend, seeded_prompts(1, 9, 37, 20, 3), kind)


def test_prefix_cache_hit_keeps_tokens(tiny):
    """A prefix-cache hit (48 tokens: past the NoPE layers' temperature steps) changes no token."""
    model_dir, hf = tiny("scout")
    assert_prefix_hit_keeps_tokens(model_dir, hf, seeded_prompts(48)[0], seeded_prompts(11, 20))


def test_layers_as_the_config_says(tiny):
    """Scout's layers all have experts, Maverick's every second; RoPE and NoPE alternate; the checkpoint's
    stacked experts really are [E, H, 2I] (transposed against ours)."""
    from vllmini.models.llama4 import Llama4MoE

    for kind, moe in (("scout", [True] * 4), ("maverick", [False, True, False, True])):
        model_dir, hf = tiny(kind)
        model = LLM(model=model_dir, kv_cache_memory=KV).llm_engine.model
        assert [isinstance(layer.mlp, Llama4MoE) for layer in model.model.layers] == moe
        assert [layer.self_attn.use_rope for layer in model.model.layers] == [True, False, True, False]
    tensors = load_file(Path(model_dir) / "model.safetensors")
    assert tuple(tensors["model.layers.1.feed_forward.experts.gate_up_proj"].shape) == (4, 64, 64)


def test_temperature_tuning_changes_the_nope_layers(tiny, tmp_path):
    """With the temperature off, the same weights give other logits past position 3 (so the tests above
    exercise it); transformers agrees on those too."""
    from helpers import hf_last_logits, prompt_forward

    model_dir, _ = tiny("scout")
    off = shutil.copytree(model_dir, tmp_path / "off")
    config = json.loads((off / "config.json").read_text())
    (off / "config.json").write_text(json.dumps({**config, "attn_temperature_tuning": False}))
    prompts = seeded_prompts(3, 30)
    hf_off = T.AutoModelForCausalLM.from_pretrained(off).eval()
    ours_off = prompt_forward(LLM(model=str(off), kv_cache_memory=KV).llm_engine.model, prompts)
    ours_on = prompt_forward(LLM(model=model_dir, kv_cache_memory=KV).llm_engine.model, prompts)
    torch.testing.assert_close(ours_off, hf_last_logits(hf_off, prompts), atol=1e-4, rtol=0)
    torch.testing.assert_close(ours_off[0], ours_on[0], atol=1e-5, rtol=0)  # (positions 0..2: scale 1)
    assert (ours_off[1] - ours_on[1]).abs().max() > 1e-3


def test_max_model_len_is_capped_at_the_attention_chunk(tiny):
    """Chunked local attention is not built: max_model_len defaults to attention_chunk_size, and a longer
    one is refused by name."""
    model_dir, _ = tiny("scout")
    assert LLM(model=model_dir, kv_cache_memory=KV).llm_engine.max_model_len == 128
    with pytest.raises(ValueError, match="attention_chunk_size"):
        LLM(model=model_dir, max_model_len=129, kv_cache_memory=KV)


def save_random_multimodal(out: Path, tokenizer_dir: Path):
    """A Llama4ForConditionalGeneration over the scout text config and a one-layer vision model, saved by
    transformers 5.25 (``language_model.model.*``, ``vision_model.*``, ``multi_modal_projector.*``)."""
    text = {**tiny_config("scout").to_dict()}
    text.pop("architectures")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=64)  # fmt: skip
    config = T.Llama4Config(text_config=text, vision_config=vision, image_token_index=511, boi_token_index=510,
                            eoi_token_index=509, architectures=["Llama4ForConditionalGeneration"])  # fmt: skip
    torch.manual_seed(0)
    hf = T.Llama4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, tensor in hf.named_parameters():
            if "norm" in name:
                tensor.normal_(1.0, 0.3)
    hf.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, out / name)
    return str(out), hf


def test_conditional_generation_serves_its_language_model(tmp_path, default_model_dir):
    """Scout / Maverick's checkpoint layout: the language model matches transformers' whole model on text."""
    model_dir, hf = save_random_multimodal(tmp_path / "mm", default_model_dir)
    names = load_file(Path(model_dir) / "model.safetensors")
    assert any(n.startswith("language_model.model.layers.") for n in names)
    assert any(n.startswith("vision_model.") for n in names)
    hf.config.architectures = ["Llama4ForCausalLM"]  # (assert_chunked_batch_matches checks our class by it)
    assert_chunked_batch_matches(model_dir, hf, "cpu", seeded_prompts(1, 9, 37, 20, 3), "llama4 multimodal")


def test_release_config_with_an_int_temperature_tuning_loads(tmp_path, default_model_dir):
    """Scout / Maverick's config.json as published says ``"attn_temperature_tuning": 4`` (transformers
    4.51 tested it for truth; 5.x's strict config refuses an int): model and tokenizer load it as True."""
    model_dir, hf = save_random_multimodal(tmp_path / "mm", default_model_dir)
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "text_config": {**config["text_config"], "attn_temperature_tuning": 4}}))
    with pytest.raises(Exception, match="attn_temperature_tuning"):
        T.AutoConfig.from_pretrained(model_dir)  # (what transformers alone does with it)
    hf.config.architectures = ["Llama4ForCausalLM"]
    assert_chunked_batch_matches(model_dir, hf, "cpu", seeded_prompts(9, 30), "llama4 release config")
