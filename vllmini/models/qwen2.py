"""Qwen2 / Qwen2.5: the Llama decoder with a bias on the q, k and v projections (not on o_proj)."""
from __future__ import annotations

from vllmini.models.llama import DecoderVariant, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    variant = DecoderVariant(qkv_bias=True, o_bias=False, mlp_bias=False, sliding="layer_types")  # whatever the config says
