"""ByteDance Seed-OSS (``SeedOssForCausalLM``: Seed-OSS-36B), as transformers' modeling_seed_oss.py:
Llama's decoder with q/k/v biases from ``attention_bias``, the o_proj bias from its own
``attention_out_bias`` (false in the release) and the MLP's from ``mlp_bias``; ``head_dim`` from the
config; the dropouts are training-only."""
from __future__ import annotations

from typing import Any

from vllmini.models.llama import DecoderVariant, LlamaForCausalLM


class SeedOssForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any) -> None:
        self.variant = DecoderVariant(o_bias=bool(getattr(config, "attention_out_bias", False)))
        super().__init__(config)
