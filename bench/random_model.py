"""Random-weight models built in code: no hub, no network, no default-model wheel.

Throughput depends on shapes, not on weight values, so a model with a real model's
config and random weights measures the same work; the GPU check uses these on a machine
where nothing can be downloaded. The tokenizer is a word-level one (``t0``, ``t1``, ...)
covering the whole vocabulary, so that any token id decodes; workloads use token ids.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import PretrainedConfig, Qwen3Config


def qwen3_06b_config(**overrides) -> Qwen3Config:
    """Qwen3-0.6B's shapes (as nano-vllm's benchmark uses it)."""
    kw = dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
        rope_theta=1000000.0, max_position_embeddings=40960, rms_norm_eps=1e-6,
        initializer_range=0.02, architectures=["Qwen3ForCausalLM"],
    )  # fmt: skip
    kw.update(overrides)
    return Qwen3Config(**kw)


def tiny_qwen3_bench_config(**overrides) -> Qwen3Config:
    """The same architecture at test size (CPU smoke runs)."""
    return qwen3_06b_config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, **overrides,
    )  # fmt: skip


def qwen3_moe_small_config(**overrides) -> PretrainedConfig:
    """Qwen3-30B-A3B's layout (64 experts of which 8 per token, narrow experts, GQA) at a size a
    CPU benchmark loads twice: 8 layers, hidden 1024, about 0.5B parameters, 1/8 of the experts active."""
    from transformers import Qwen3MoeConfig

    kw = dict(
        vocab_size=32000, hidden_size=1024, intermediate_size=3072, moe_intermediate_size=256,
        num_experts=64, num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64, tie_word_embeddings=False,
        rope_theta=1000000.0, max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=0.02,
        architectures=["Qwen3MoeForCausalLM"],
    )  # fmt: skip
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def gpt_oss_small_config(**overrides) -> PretrainedConfig:
    """gpt-oss-20b's layout (layers alternating a 128-token window and full attention, sinks, 32 experts
    of which 4 per token, biases, q wider than hidden) at a size a CPU benchmark loads twice: 8 layers,
    hidden 768, about 0.5B parameters."""
    from transformers import GptOssConfig

    kw = dict(
        vocab_size=32000, hidden_size=768, intermediate_size=768, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=4, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 4, max_position_embeddings=8192,
        rope_parameters={"rope_type": "yarn", "factor": 2.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
        tie_word_embeddings=False, initializer_range=0.02, pad_token_id=0, eos_token_id=1,
        architectures=["GptOssForCausalLM"],
    )  # fmt: skip
    kw.update(overrides)
    return GptOssConfig(**kw)


def deepseek_v2_lite_small_config(**overrides) -> PretrainedConfig:
    """DeepSeek-V2-Lite's layout (MLA without q_lora: a 512 + 64 latent cached per token, 16 heads of 128 + 64 /
    128; 64 experts of which 6 per token plus 2 shared, the first layer dense) at a size a CPU benchmark loads
    twice: 8 layers, hidden 1024, about 0.45B parameters."""
    from transformers import DeepseekV2Config

    kw = dict(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=256, num_hidden_layers=8,
        num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1,
        topk_method="greedy", max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=0.02,
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, architectures=["DeepseekV2ForCausalLM"],
    )  # fmt: skip
    kw.update(overrides)
    return DeepseekV2Config(**kw)


def qwen3_5_small_config(**overrides) -> PretrainedConfig:
    """Qwen3.5's layout (three Gated DeltaNet linear-attention layers to every gated full-attention
    layer, 2x as many value heads as key heads in the linear layers, a quarter of each attention head
    rotated) at a size a CPU benchmark loads twice: 8 layers, hidden 1024, about 0.17B parameters."""
    from transformers import Qwen3_5TextConfig

    kw = dict(
        vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, max_position_embeddings=4096,
        rms_norm_eps=1e-6, initializer_range=0.02, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
        architectures=["Qwen3_5ForCausalLM"],
    )  # fmt: skip
    kw.update(overrides)
    return Qwen3_5TextConfig(**kw)


def granite4_h_small_config(**overrides) -> PretrainedConfig:
    """Granite-4.0-H-Micro's layout (Mamba2 layers, three to every NoPE attention layer, a dense shared MLP,
    Granite's multipliers) at a size a CPU benchmark loads twice: 8 layers, hidden 1024, ~0.2B parameters."""
    from transformers import GraniteMoeHybridConfig

    kw = dict(
        vocab_size=32000, hidden_size=1024, intermediate_size=2048, shared_intermediate_size=2048, num_local_experts=0,
        num_experts_per_tok=0, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
        layer_types=["mamba", "mamba", "mamba", "attention"] * 2, mamba_n_heads=32, mamba_d_head=64, mamba_n_groups=1,
        mamba_d_state=128, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, position_embedding_type="nope",
        embedding_multiplier=12.0, attention_multiplier=0.0078125, residual_multiplier=0.22, logits_scaling=4.0,
        max_position_embeddings=4096, rms_norm_eps=1e-5, initializer_range=0.02, tie_word_embeddings=True,
        pad_token_id=0, eos_token_id=1, architectures=["GraniteMoeHybridForCausalLM"],
    )  # fmt: skip
    kw.update(overrides)
    return GraniteMoeHybridConfig(**kw)


def save_word_level_tokenizer(vocab_size: int, out_dir: Path) -> None:
    """A fast tokenizer whose tokens are ``t<id>`` for every id (EOS ``t1``, pad ``t0``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", pad_token="t0", unk_token="t0").save_pretrained(
        out_dir
    )


@torch.no_grad()
def save_random_model(config: PretrainedConfig, out_dir: Path, dtype: torch.dtype = torch.bfloat16,
                      device: str | torch.device = "cpu", seed: int = 0) -> Path:  # fmt: skip
    """An HF directory (config.json, model.safetensors, tokenizer) with random weights,
    initialised on ``device`` (fast on a GPU for a 0.6B model) and saved in ``dtype``."""
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out_dir)
    save_word_level_tokenizer(config.vocab_size, out_dir)
    return out_dir


CONFIGS = {"qwen3-0.6b": qwen3_06b_config, "qwen3-moe-small": qwen3_moe_small_config,
           "gpt-oss-small": gpt_oss_small_config, "deepseek-v2-lite-small": deepseek_v2_lite_small_config,
           "qwen3.5-small": qwen3_5_small_config, "granite4-h-small": granite4_h_small_config}

if __name__ == "__main__":  # python -m bench.random_model qwen3-moe-small OUT_DIR [--dtype float32]
    import argparse

    ap = argparse.ArgumentParser(description="save a random-weight model of a named shape")
    ap.add_argument("shape", choices=sorted(CONFIGS))
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    cli = ap.parse_args()
    print(save_random_model(CONFIGS[cli.shape](), Path(cli.out_dir), getattr(torch, cli.dtype)))
