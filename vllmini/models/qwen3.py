"""Qwen3: the Llama decoder plus per-head RMSNorm on q and k before RoPE.

Qwen3 configs set ``head_dim`` explicitly (it may differ from hidden/heads); the
shared decoder already reads it.
"""
from __future__ import annotations

from vllmini.models.llama import DecoderVariant, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    variant = DecoderVariant(qk_norm=True, mlp_bias=False, sliding="layer_types")  # attention_bias is read, mlp_bias is not
