"""Tencent Hunyuan v1 (``HunYuanDenseV1ForCausalLM``: Hunyuan-0.5B..7B; ``HunYuanMoEV1ForCausalLM``:
Hunyuan-A13B), as transformers' modeling_hunyuan_v1_dense.py / modeling_hunyuan_v1_moe.py:
- Llama's pre-norm layer, biases from ``attention_bias`` (none in the MLP); a per-head RMSNorm on q
  and k (``query_layernorm`` / ``key_layernorm``) applied AFTER the rotary embedding;
- rope ``dynamic`` with an ``alpha`` (the releases' NTK-alpha) is a fixed base, not a length-dependent
  one: ``rope_theta * alpha ** (head_dim / (head_dim - 2))``; without ``alpha`` it is the usual dynamic NTK;
- MoE: experts ``intermediate_size`` wide in every layer, softmax over the router (``mlp.gate.wg``, in
  float32), top ``moe_topk`` always renormalised, plus the shared MLP (``mlp.shared_mlp``) every token
  goes through, added unweighted.
Not built, refused by name: cross-layer attention (``use_cla``), expert widths other than
``intermediate_size`` (``moe_intermediate_size``), several shared experts (``num_shared_expert``)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllmini.models.deepseek import RouterGate
from vllmini.models.layers import GatedMLP
from vllmini.models.llama import DecoderVariant, LlamaForCausalLM
from vllmini.models.moe import FusedMoE
from vllmini.models.rotary import RotaryEmbedding, rope_parameters

def _per_layer(value: Any, layer_idx: int) -> Any:
    """A config value that may be given once or per layer (a list)."""
    return value[layer_idx] if isinstance(value, list) else value


class HunYuanMoE(FusedMoE):
    """Softmax top-k renormalised, the router in float32, plus the always-on shared MLP."""

    def __init__(self, config: Any, layer_idx: int) -> None:
        act = getattr(config, "hidden_act", "silu")
        super().__init__(config.hidden_size, config.intermediate_size, int(config.num_experts),
                         int(_per_layer(config.moe_topk, layer_idx)), True, act)  # fmt: skip
        self.gate = RouterGate(config.hidden_size, self.num_experts, correction_bias=False)
        self.shared_mlp = GatedMLP(config.hidden_size, config.intermediate_size, act=act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shared_mlp(x)


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    variant = DecoderVariant(qk_norm=True, qk_norm_after_rope=True, mlp_bias=False)
    checkpoint_renames = ((".self_attn.query_layernorm.", ".self_attn.q_norm."),
                          (".self_attn.key_layernorm.", ".self_attn.k_norm."), (".mlp.gate.wg.", ".mlp.gate."))  # fmt: skip

    def __init__(self, config: Any) -> None:
        name = type(self).__name__
        if getattr(config, "use_cla", False):
            raise ValueError(f"use_cla=true (cross-layer attention) is not supported for {name}")
        super().__init__(config)
        params = rope_parameters(config)
        if params["rope_type"] == "dynamic" and params.get("alpha"):  # (transformers' "ntk_alpha")
            dim = self.head_dim
            theta = float(params["rope_theta"]) * float(params["alpha"]) ** (dim / (dim - 2))
            params = {**params, "rope_type": "default", "rope_theta": theta}
            self.model.rotary_emb = RotaryEmbedding(dim, params)


class HunYuanMoEV1ForCausalLM(HunYuanDenseV1ForCausalLM):
    def __init__(self, config: Any) -> None:
        name, width = type(self).__name__, config.intermediate_size
        for field, built in (("moe_intermediate_size", width), ("num_shared_expert", 1)):
            value = getattr(config, field, None)
            if value is not None and any(v != built for v in (value if isinstance(value, list) else [value])):
                raise ValueError(f"{field}={value} is not supported for {name}; supported: {built} "
                                 f"(as transformers builds it)")  # fmt: skip
        if isinstance(getattr(config, "num_experts", None), list):
            raise ValueError(f"num_experts given per layer is not supported for {name}; supported: one number")
        super().__init__(config)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return HunYuanMoE(self.config, layer_idx)
