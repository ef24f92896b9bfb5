"""Qwen2, Mistral, Phi-3 and SmolLM3 checkpoints through the whole engine (config.json -> registry -> weights ->
paged forward), greedy equal to transformers', including sliding-window attention."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import (assert_greedy_matches, hf_greedy, hf_last_logits, prompt_forward, randomize_biases, save_tiny_model, tiny_llama_config,
                     tiny_mistral_config, tiny_phi3_config, tiny_qwen2_config, tiny_smollm3_config)  # fmt: skip
from test_engine import assert_no_leaks
from vllmini import LLM, SamplingParams

MAKERS = {"qwen2": tiny_qwen2_config, "mistral": tiny_mistral_config, "phi3": tiny_phi3_config,
          "smollm3": tiny_smollm3_config, "llama": tiny_llama_config}  # fmt: skip


def tiny_dir(tmp_path_factory, default_model_dir, arch: str, **overrides):
    torch.manual_seed(0)
    config = MAKERS[arch](vocab_size=49152, initializer_range=0.05, **overrides)
    hf = randomize_biases(AutoModelForCausalLM.from_config(config), std=0.1).eval()
    return str(save_tiny_model(hf, tmp_path_factory.mktemp(arch), default_model_dir)), hf


@pytest.mark.parametrize("arch", sorted(MAKERS))
def test_engine_greedy_matches_transformers(tmp_path_factory, default_model_dir, arch):
    model_dir, hf = tiny_dir(tmp_path_factory, default_model_dir, arch)
    llm = LLM(model=model_dir, max_num_batched_tokens=32)  # chunked prefill too
    assert type(llm.llm_engine.model).__name__ == hf.config.architectures[0]
    g = torch.Generator().manual_seed(5)
    assert_engine_greedy(llm, hf, [torch.randint(100, 4000, (n,), generator=g).tolist() for n in (1, 9, 50)], 12, arch)


def assert_engine_greedy(llm, hf, prompts: list[list[int]], max_tokens: int, what: str) -> None:
    """The engine's greedy tokens for ``prompts`` (one batch) are transformers' (near-tie rule)."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)  # fmt: skip
    for p, out in zip(prompts, outs):
        want, gaps = hf_greedy(hf, p, max_tokens)
        assert_greedy_matches(out.outputs[0].token_ids, want, gaps, f"{what}, prompt of {len(p)}")
    assert_no_leaks(llm)


def assert_chunked_batch_matches(model_dir: str, hf, backend: str, prompts: list[list[int]], what: str) -> None:
    """Last-position logits of ``prompts`` as one flat batch within 1e-4 of transformers'; their
    greedy tokens, prefilled in chunks of 16 beside decode rows on ``backend``, equal to transformers'."""
    llm = LLM(model=model_dir, max_num_batched_tokens=16, max_num_seqs=4, attention_backend=backend)
    model = llm.llm_engine.model
    assert type(model).__name__ == hf.config.architectures[0]
    torch.testing.assert_close(prompt_forward(model, prompts), hf_last_logits(hf, prompts), atol=1e-4, rtol=0)
    assert_engine_greedy(llm, hf, prompts, 10, what)
    assert llm.llm_engine.scheduler.stats.num_chunked_prefills > 0


def assert_prefix_hit_keeps_tokens(model_dir: str, hf, prefix: list[int], tails: list[list[int]]) -> None:
    """Two prompts sharing ``prefix`` (whole blocks), one after the other: the second reuses those
    blocks from the prefix cache and both give transformers' greedy tokens."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm = LLM(model=model_dir, enable_prefix_caching=True)
    first, second = (llm.generate({"prompt_token_ids": prefix + t}, params, use_tqdm=False)[0] for t in tails)
    assert (first.metrics.num_cached_tokens, second.metrics.num_cached_tokens) == (0, len(prefix))
    for tail, out in zip(tails, (first, second)):
        assert_greedy_matches(out.outputs[0].token_ids, *hf_greedy(hf, prefix + tail, 8), "prefix cache")
    assert_no_leaks(llm)


@pytest.mark.parametrize(
    ("arch", "overrides", "windows"),
    [
        ("mistral", {"sliding_window": 12}, [12] * 3),  # Mistral 7B v0.1 style: every layer slides
        ("phi3", {"sliding_window": 9}, [9] * 3),  # Phi-3-mini-4k sets 2047
        ("qwen2", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1}, [None, 12, 12]),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 28}, [None] * 3),
        ("qwen2", {"use_sliding_window": False, "sliding_window": 12}, [None] * 3),
        ("smollm3", {"use_sliding_window": True, "sliding_window": 12, "no_rope_layer_interval": 2}, [None, 12, None]),
    ],
)
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_sliding_window_attention_matches_transformers(tmp_path_factory, default_model_dir, arch, overrides, windows,
                                                       backend):  # fmt: skip
    """Sequences several windows long, prefilled in chunks (a chunk after cached tokens sees
    only the window behind each query) then decoded: greedy equal to transformers with its
    sliding-window mask, on both CPU backends, with per-layer windows (Qwen2's max_window_layers)."""
    model_dir, hf = tiny_dir(tmp_path_factory, default_model_dir, arch, num_hidden_layers=3, **overrides)
    llm = LLM(model=model_dir, attention_backend=backend, max_num_batched_tokens=16, enable_prefix_caching=True)
    assert [layer.self_attn.attn.window for layer in llm.llm_engine.model.model.layers] == windows
    assert llm.llm_engine.max_model_len == 1024  # not capped at the window
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(100, 4000, (n,), generator=g).tolist() for n in (5, 40, 29)]
    prompts.append(prompts[1][:30] + prompts[2][:8])  # a prefix-cache hit ahead of a fresh chunk
    assert_engine_greedy(llm, hf, prompts, 20, f"{arch} {backend}")


@pytest.mark.parametrize(
    ("arch", "overrides", "windows"),
    [  # transformers' Mistral ignores layer_types (it warns) and slides in every layer
        ("mistral", {"layer_types": ["sliding_attention"] + ["full_attention"] * 2}, [12] * 3),
        ("llama", {}, [None] * 3),  # transformers' Llama attention has no sliding window
    ],
)
def test_sliding_window_keys_the_architecture_ignores(tmp_path_factory, default_model_dir, arch, overrides, windows):
    """Configs whose sliding-window keys transformers' model code reads its own way: last-position
    logits of a prompt three windows long equal its forward's (one forward: its generate() builds
    a cache from those keys that its forward does not match)."""
    from helpers import prompt_forward

    model_dir, hf = tiny_dir(tmp_path_factory, default_model_dir, arch, num_hidden_layers=3, sliding_window=12,
                             **overrides)  # fmt: skip
    model = LLM(model=model_dir).llm_engine.model
    assert [layer.self_attn.attn.window for layer in model.model.layers] == windows
    prompt = torch.randint(100, 4000, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(prompt_forward(model, [prompt])[0], want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "phi3"])
def test_bias_keys_these_architectures_ignore(tmp_path_factory, default_model_dir, arch):
    """transformers' Qwen2, Mistral and Phi3 fix their biases (Qwen2: q/k/v only) whatever
    attention_bias / mlp_bias say; a config that sets them must load as transformers loads it."""
    model_dir, hf = tiny_dir(tmp_path_factory, default_model_dir, arch, attention_bias=True, mlp_bias=True)
    llm = LLM(model=model_dir)
    layer = llm.llm_engine.model.model.layers[0]
    assert (layer.self_attn.qkv_proj.bias is not None) == (arch == "qwen2")
    assert layer.self_attn.o_proj.bias is None and layer.mlp.down_proj.bias is None
    assert_engine_greedy(llm, hf, [list(range(300, 320))], 8, arch)


def test_tied_config_with_its_own_lm_head_is_untied(tmp_path, default_model_dir):
    """tie_word_embeddings with an lm_head.weight that differs from the embedding: transformers
    unties them and uses the checkpoint's lm_head, and so does the engine (an equal copy, as
    some exporters write, stays tied)."""
    from safetensors.torch import load_file, save_file

    from helpers import tiny_qwen3_config

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_qwen3_config(vocab_size=49152, initializer_range=0.05)).eval()
    save_tiny_model(hf, tmp_path, default_model_dir)
    tensors = load_file(tmp_path / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    for head, tied in ((embed.clone(), True), (torch.randn_like(embed) * 0.05, False)):
        save_file({**tensors, "lm_head.weight": head}, tmp_path / "model.safetensors", metadata={"format": "pt"})
        ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
        assert torch.equal(ref.lm_head.weight, head)
        llm = LLM(model=str(tmp_path))
        assert llm.llm_engine.hf_config.tie_word_embeddings == tied
        assert_engine_greedy(llm, ref, [list(range(300, 320))], 8, f"tied={tied}")


@pytest.mark.parametrize(("arch", "overrides"), [("mistral", {"sliding_window": 12}),
                                                 ("qwen2", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1})])
def test_disable_sliding_window(tmp_path_factory, default_model_dir, arch, overrides):
    """vLLM's disable_sliding_window: every layer attends to all earlier tokens and max_model_len is capped at
    the window, where the two attentions agree: greedy equal to transformers' sliding model."""
    model_dir, hf = tiny_dir(tmp_path_factory, default_model_dir, arch, num_hidden_layers=3, **overrides)
    llm = LLM(model=model_dir, disable_sliding_window=True)
    assert [layer.self_attn.attn.window for layer in llm.llm_engine.model.model.layers] == [None] * 3
    assert llm.llm_engine.max_model_len == 12
    assert_engine_greedy(llm, hf, [list(range(300, 305)), list(range(400, 403))], 6, f"{arch} without its window")
    with pytest.raises(ValueError, match=r"max_model_len=20 exceeds .* 12 \(the sliding window, as disable_sliding"):
        LLM(model=model_dir, disable_sliding_window=True, max_model_len=20)
    plain, _ = tiny_dir(tmp_path_factory, default_model_dir, "llama")  # no window: nothing changes
    assert LLM(model=plain, disable_sliding_window=True).llm_engine.max_model_len == 1024
