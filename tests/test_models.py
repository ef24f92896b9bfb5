"""Parity with HF transformers on the same weights: logits and greedy continuations."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers import LlamaForCausalLM as HFLlama
from transformers import MistralForCausalLM as HFMistral
from transformers import Phi3ForCausalLM as HFPhi3
from transformers import Qwen2ForCausalLM as HFQwen2
from transformers import Qwen3ForCausalLM as HFQwen3
from transformers import SmolLM3ForCausalLM as HFSmolLM3

from helpers import (assert_greedy_matches, greedy_paged, hf_greedy, hf_last_logits, prompt_forward,
                     randomize_biases, tiny_llama_config, tiny_mistral_config, tiny_phi3_config, tiny_qwen2_config,
                     tiny_qwen3_config, tiny_smollm3_config)  # fmt: skip
from vllmini.models.llama import LlamaForCausalLM
from vllmini.models.qwen2 import Qwen2ForCausalLM
from vllmini.models.qwen3 import Qwen3ForCausalLM
from vllmini.models.weight_loader import load_model

LENGTHS = [1, 5, 17, 40, 77]


CASES = {
    "llama3-rope-gqa-untied": (tiny_llama_config, HFLlama, LlamaForCausalLM),
    "qwen3-headdim-tied": (tiny_qwen3_config, HFQwen3, Qwen3ForCausalLM),
    "qwen2-qkvbias-tied": (tiny_qwen2_config, HFQwen2, Qwen2ForCausalLM),
    "mistral-headdim": (tiny_mistral_config, HFMistral, LlamaForCausalLM),
    "phi3-fused": (tiny_phi3_config, HFPhi3, LlamaForCausalLM),
    "smollm3-nope-tied": (tiny_smollm3_config, HFSmolLM3, LlamaForCausalLM),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny_pair(request):
    make_config, hf_cls, our_cls = CASES[request.param]
    torch.manual_seed(0)
    config = make_config()
    hf = randomize_biases(hf_cls(config)).eval()
    ours = our_cls(config)
    loaded = ours.load_weights(hf.state_dict().items())
    assert loaded == {n for n, _ in ours.named_parameters()}
    return request.param, hf, ours.eval()


def _prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def test_tiny_configs_exercise_the_features(tiny_pair):
    name, hf, ours = tiny_pair
    attn = ours.model.layers[0].self_attn
    assert attn.num_kv_heads < attn.num_heads  # GQA
    tied = ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    assert tied == name.endswith("-tied")
    if name.startswith("llama"):
        assert ours.model.rotary_emb.params["rope_type"] == "llama3"
    if name.startswith(("qwen3", "mistral")):
        assert attn.head_dim != hf.config.hidden_size // hf.config.num_attention_heads
    assert (attn.q_norm is not None) == name.startswith("qwen3")
    # Qwen2: bias on q/k/v, none on o_proj
    assert (attn.qkv_proj.bias is not None, attn.o_proj.bias is not None) == (name.startswith("qwen2"), False)
    if attn.qkv_proj.bias is not None:
        assert attn.qkv_proj.bias.abs().min() > 0  # loaded from the (randomised) checkpoint
    assert ours.sliding_window is None
    ropes = [layer.self_attn.use_rope for layer in ours.model.layers]
    assert ropes == ([True, True, True, False] if name.startswith("smollm3") else [True] * len(ropes))


def test_tiny_logits_match_in_one_flat_batch(tiny_pair):
    _, hf, ours = tiny_pair
    prompts = _prompts(hf.config.vocab_size, LENGTHS)
    logits = prompt_forward(ours, prompts)
    assert logits.shape == (len(prompts), hf.config.vocab_size)
    torch.testing.assert_close(logits, hf_last_logits(hf, prompts), atol=1e-4, rtol=0)


def test_tiny_greedy_matches_generate(tiny_pair):
    name, hf, ours = tiny_pair
    prompts = _prompts(hf.config.vocab_size, LENGTHS, seed=2)
    outs = greedy_paged(ours, prompts, 32)
    for p, o in zip(prompts, outs):
        tokens, gaps = hf_greedy(hf, p, 32)
        assert_greedy_matches(o, tokens, gaps, f"{name} prompt of {len(p)}")


def test_near_tie_rule_is_enforced():
    with pytest.raises(AssertionError, match="not a near tie"):
        assert_greedy_matches([1, 2, 3], [1, 2, 4], [1.0, 1.0, 0.5])
    assert_greedy_matches([1, 2, 3], [1, 9, 9], [1.0, 5e-5, 1.0])  # tolerated: near tie at step 1


@pytest.fixture(scope="module")
def default_pair(default_model_dir):
    ours, _ = load_model(default_model_dir, torch.float32, torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    return ours, hf


@pytest.fixture(scope="module")
def default_prompts(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        chat,
        "Once upon a time, in a small village by the sea, there lived an old fisherman who",
        "1, 2, 3, 4,",
    ]
    return [tok(t, add_special_tokens=False).input_ids for t in texts]


def test_default_model_logits_match(default_pair, default_prompts):
    ours, hf = default_pair
    logits = prompt_forward(ours, default_prompts)
    torch.testing.assert_close(logits, hf_last_logits(hf, default_prompts), atol=1e-4, rtol=0)


def test_default_model_greedy_matches_generate(default_pair, default_prompts):
    """20 tokens of each prompt (transformers' generate, one prompt at a time, is most of this
    test's time; test_engine holds longer outputs of the default model to it through the engine)."""
    ours, hf = default_pair
    outs = greedy_paged(ours, default_prompts, 20)
    for p, o in zip(default_prompts, outs):
        tokens, gaps = hf_greedy(hf, p, 20)
        assert_greedy_matches(o, tokens, gaps, f"default model, prompt of {len(p)} tokens")
