"""Rope scaling types (models/rotary.py) against transformers: the cos/sin of its rotary modules,
then whole tiny models through the engine (greedy and logits equal to transformers'), and the
context length each type gives max_model_len, as vLLM derives it."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Phi3Config, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from helpers import prompt_forward, save_tiny_model, tiny_llama_config, tiny_phi3_config, tiny_qwen3_config
from test_architectures import assert_engine_greedy
from vllmini import LLM
from vllmini.config import resolve_max_model_len
from vllmini.models.rotary import RotaryEmbedding, rope_parameters

SHAPE = dict(hidden_size=64, num_attention_heads=4)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
# Phi-4-mini's shape: 3/4 of each head rotates; LongRoPE needs one factor per rotated frequency (16 * 3/4 / 2)
LONG = {"rope_type": "longrope", "long_factor": [1.0 + 0.7 * i for i in range(6)],
        "short_factor": [1.0 + 0.1 * i for i in range(6)]}  # fmt: skip
PHI4_MINI = dict(partial_rotary_factor=0.75, max_position_embeddings=128, original_max_position_embeddings=32,
                 rope_scaling=LONG)  # fmt: skip

CASES = {  # name: (transformers' rotary module, config, positions, the engine's max_model_len)
    "yarn": (Qwen3RotaryEmbedding, Qwen3Config(**SHAPE, head_dim=24, max_position_embeddings=32, rope_scaling=YARN),
             128, 128),
    "yarn-deepseek-mscale": (LlamaRotaryEmbedding, LlamaConfig(**SHAPE, max_position_embeddings=64, rope_scaling={
        **YARN, "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2}), 64, 128),
    "yarn-attention-factor-untruncated": (LlamaRotaryEmbedding, LlamaConfig(**SHAPE, max_position_embeddings=64,
        rope_scaling={**YARN, "attention_factor": 0.9, "truncate": False}), 64, 128),  # fmt: skip
    # dynamic NTK: within the original context the plain frequencies; fitted to a longer one, transformers'
    # base for a sequence of exactly that length
    "dynamic-within": (LlamaRotaryEmbedding, LlamaConfig(**SHAPE, max_position_embeddings=32,
                                                         rope_scaling={"rope_type": "dynamic", "factor": 2.0}), 32, 32),
    "dynamic-fitted": (LlamaRotaryEmbedding, LlamaConfig(**SHAPE, max_position_embeddings=32,
                                                         rope_scaling={"rope_type": "dynamic", "factor": 2.0}), 64, 64),
    # LongRoPE: transformers takes the long factors once a forward passes the original context
    "longrope-long": (Phi3RotaryEmbedding, Phi3Config(**SHAPE, **PHI4_MINI), 40, 128),
    "longrope-short": (Phi3RotaryEmbedding, Phi3Config(**SHAPE, **PHI4_MINI), 32, 32),
    "linear": (LlamaRotaryEmbedding, LlamaConfig(**SHAPE, rope_scaling={"rope_type": "linear", "factor": 4.0}), 50, 50),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_cos_sin_equal_transformers(name):
    hf_cls, config, n, max_model_len = CASES[name]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    ours = RotaryEmbedding(head_dim, rope_parameters(config))
    ours.fit_context(max_model_len)
    positions = torch.arange(n)
    cos, sin = hf_cls(config)(torch.zeros(1), positions[None])
    our_cos, our_sin = ours.cos_sin(positions)
    torch.testing.assert_close(our_cos, cos[0], atol=2e-7, rtol=0)
    torch.testing.assert_close(our_sin, sin[0], atol=2e-7, rtol=0)
    if name.startswith(("yarn", "longrope")):
        assert ours.attention_scaling != 1.0  # the attention factor is part of what was compared


def test_longrope_picks_its_factors_from_the_engine_context():
    """The long factors exactly when max_model_len exceeds the original context (as vLLM): a paged
    cache cannot re-rotate its keys when a sequence crosses it, as transformers' switch would."""
    rope = RotaryEmbedding(16, rope_parameters(Phi3Config(**SHAPE, **PHI4_MINI)))
    assert rope.context_len == 128  # before fit_context: the model's own context, long
    long_freq = rope.inv_freq.clone()
    rope.fit_context(32)
    short_freq = rope.inv_freq.clone()
    rope.fit_context(33)
    torch.testing.assert_close(rope.inv_freq, long_freq, rtol=0, atol=0)
    assert not torch.equal(short_freq, long_freq)
    su = SimpleNamespace(**{**PHI4_MINI, "rope_scaling": {**LONG, "type": "su"}})  # Phi-3's first name for it
    assert rope_parameters(su)["rope_type"] == "longrope"
    bad = SimpleNamespace(**{**PHI4_MINI, "rope_scaling": {**LONG, "long_factor": [1.0] * 8}})  # (transformers refuses it)
    with pytest.raises(ValueError, match="longrope long_factor has 8 values; the rotary dims need 6"):
        RotaryEmbedding(16, rope_parameters(bad))


@pytest.mark.parametrize(
    ("config", "length", "why"),
    [
        (Qwen3Config(max_position_embeddings=40960, rope_scaling={**YARN, "original_max_position_embeddings": 32768}),
         131072, "yarn: 32768 original tokens x4.0"),  # Qwen3's documented long-context setting
        (LlamaConfig(max_position_embeddings=4096, rope_scaling={"rope_type": "dynamic", "factor": 2.0}), 8192,
         "x2.0 dynamic rope scaling"),
        (Phi3Config(max_position_embeddings=131072, original_max_position_embeddings=4096, rope_scaling={
            "rope_type": "longrope", "long_factor": [1.0] * 48, "short_factor": [1.0] * 48}), 131072, ""),
    ],
)
def test_context_length_of_each_scaling(config, length, why):
    assert resolve_max_model_len(None, config) == length
    if why:
        with pytest.raises(ValueError, match=rf"exceeds the model's context length {length} \(config.json, {why}\)"):
            resolve_max_model_len(length + 1, config)


def _tiny_dir(tmp_path_factory, default_model_dir, make, **overrides):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(make(vocab_size=49152, initializer_range=0.05, **overrides)).eval()
    return str(save_tiny_model(hf, tmp_path_factory.mktemp("rope"), default_model_dir)), hf


def _prompts(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(100, 4000, (n,), generator=g).tolist() for n in lengths]


def _assert_logits(llm, hf, prompt: list[int]) -> None:
    """The last position's logits of one forward over ``prompt`` equal transformers'."""
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(prompt_forward(llm.llm_engine.model, [prompt])[0], want, atol=1e-4, rtol=0)


def _assert_greedy(llm, hf, prompts, max_tokens: int, what: str) -> None:
    """Greedy tokens equal transformers' (near-tie rule), and the longest prompt's logits too."""
    _assert_logits(llm, hf, max(prompts, key=len))
    assert_engine_greedy(llm, hf, prompts, max_tokens, what)


def test_qwen3_with_yarn_matches_transformers(tmp_path_factory, default_model_dir):
    """Qwen3's long-context recipe (rope_scaling yarn, as its model card and vLLM's docs give it):
    the context becomes original x factor, and greedy tokens past the original context equal transformers'."""
    model_dir, hf = _tiny_dir(tmp_path_factory, default_model_dir, tiny_qwen3_config, max_position_embeddings=32,
                              rope_scaling=YARN)  # fmt: skip
    llm = LLM(model=model_dir, max_num_batched_tokens=32)  # chunked prefill too
    assert llm.llm_engine.max_model_len == 128
    _assert_greedy(llm, hf, _prompts(5, 30, 70), 16, "qwen3 yarn")


def test_qwen3_yarn_through_hf_overrides(tmp_path_factory, default_model_dir):
    """The same, switched on at start-up (vLLM: --hf-overrides '{"rope_scaling": {...}}') on a
    checkpoint without it: equal to transformers with the scaling, unlike the plain model."""
    model_dir, _ = _tiny_dir(tmp_path_factory, default_model_dir, tiny_qwen3_config, max_position_embeddings=32)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, rope_scaling=YARN).eval()
    llm = LLM(model=model_dir, hf_overrides={"rope_scaling": YARN}, max_model_len=100)
    prompt = _prompts(60)[0]
    _assert_logits(llm, hf, prompt)
    plain = prompt_forward(LLM(model=model_dir).llm_engine.model, [prompt[:32]])[0]
    with torch.no_grad():
        assert (plain - hf(torch.tensor([prompt[:32]])).logits[0, -1]).abs().max() > 1e-2


def test_phi4_mini_shaped_longrope_matches_transformers(tmp_path_factory, default_model_dir):
    """Phi3ForCausalLM with a partial rotary embedding and LongRoPE (Phi-4-mini, Phi-3.5-mini's
    rope): at its full context the long factors, equal to transformers on sequences past the
    original context; with max_model_len within it, the short ones, equal on sequences that fit."""
    model_dir, hf = _tiny_dir(tmp_path_factory, default_model_dir, tiny_phi3_config, num_attention_heads=4, **PHI4_MINI)
    llm = LLM(model=model_dir)
    assert llm.llm_engine.max_model_len == 128
    _assert_greedy(llm, hf, _prompts(33, 50), 16, "phi3 longrope, long factors")
    short = LLM(model=model_dir, max_model_len=32)
    _assert_greedy(short, hf, _prompts(3, 16), 16, "phi3 longrope, short factors")


def test_llama_dynamic_ntk_matches_transformers(tmp_path_factory, default_model_dir):
    """Dynamic NTK: the context doubles (factor 2, as vLLM derives it); at that length the logits
    are transformers' for a sequence of that length, and within the original context its greedy tokens."""
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    model_dir, hf = _tiny_dir(tmp_path_factory, default_model_dir, tiny_llama_config, max_position_embeddings=32,
                              rope_scaling=dynamic)  # fmt: skip
    llm = LLM(model=model_dir)
    assert llm.llm_engine.max_model_len == 64
    _assert_logits(llm, hf, _prompts(64)[0])
    _assert_greedy(LLM(model=model_dir, max_model_len=32), hf, _prompts(4, 15), 16, "llama dynamic, within")
