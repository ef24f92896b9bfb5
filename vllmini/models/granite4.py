"""IBM Granite 4.0 hybrids (``GraniteMoeHybridForCausalLM``: Granite-4.0-H-Small / H-Tiny / H-Micro):
Mamba2 layers (models/mamba2.py, a fixed-size state per sequence) mixed with Granite attention
layers (the only ones with a paged KV cache), as ``layer_types`` says ("mamba" / "attention" in
the releases' config.json, which transformers reads as "linear_attention" / "full_attention").

Every layer's MLP is a ``shared_mlp`` (a gated MLP ``shared_intermediate_size`` wide), plus, when
``num_local_experts > 0``, GraniteMoe's experts (``block_sparse_moe``, top-k softmax) summed with it.
Granite's four scalars apply as in models/granite.py. Attention layers turn RoPE only when
``position_embedding_type == "rope"`` (the H releases use none: NoPE). Attention layer ``j`` uses
``kv_caches[j]``, Mamba layer ``j`` the state tensors ``meta.state_caches[j]``.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from vllmini.models.base import AttentionMetadata
from vllmini.models.granite import GraniteForCausalLM, _moe_name
from vllmini.models.hybrid import StatefulHybrid
from vllmini.models.layers import GatedMLP
from vllmini.models.llama import DecoderLayer, DecoderVariant
from vllmini.models.mamba2 import Mamba2Mixer
from vllmini.models.moe import FusedMoE, num_experts

_MAMBA, _ATTENTION = {"mamba", "linear_attention"}, {"attention", "full_attention"}
# our names under ``mlp.`` -> the checkpoint's (for the loader's error on a missing tensor)
_CHECKPOINT_NAMES = {"gate_up_proj.weight": "shared_mlp.input_linear.weight", "down_proj.weight": "shared_mlp.output_linear.weight",
                     "shared_mlp.gate_up_proj.weight": "shared_mlp.input_linear.weight",
                     "shared_mlp.down_proj.weight": "shared_mlp.output_linear.weight",
                     "experts.w13": "block_sparse_moe.input_linear.weight", "experts.w2": "block_sparse_moe.output_linear.weight",
                     "gate.weight": "block_sparse_moe.router.layer.weight"}  # fmt: skip


class SharedMLPMoE(FusedMoE):
    """GraniteMoe's experts beside an always-on ``shared_mlp`` (no gate on it): their sum."""

    def __init__(self, config: Any) -> None:
        super().__init__(config.hidden_size, config.intermediate_size, num_experts(config), config.num_experts_per_tok,
                         True, getattr(config, "hidden_act", "silu"))  # fmt: skip
        self.shared_mlp = GatedMLP(config.hidden_size, config.shared_intermediate_size, act=getattr(config, "hidden_act", "silu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shared_mlp(x)


class GraniteHybridLayer(DecoderLayer):
    """A Granite layer whose token mixer is attention or, once ``make_mamba`` ran, Mamba2; both
    outputs (and the MLP's) scaled by ``residual_multiplier`` before they join the residual."""

    def __init__(self, config: Any, variant: DecoderVariant, mlp: nn.Module, use_rope: bool = True,
                 window: int | None = None) -> None:  # fmt: skip
        rope = use_rope and getattr(config, "position_embedding_type", None) == "rope"
        super().__init__(config, variant, mlp, rope, window)
        self.residual_multiplier = float(config.residual_multiplier)
        self.mamba: Mamba2Mixer | None = None

    def make_mamba(self, config: Any) -> None:
        self.self_attn, self.mamba = None, Mamba2Mixer(config)

    @property
    def state_mixer(self) -> nn.Module | None:
        return self.mamba

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                cache: Any) -> torch.Tensor:  # fmt: skip
        h = self.input_layernorm(x)
        h = self.mamba(h, meta, cache) if self.mamba is not None else self.self_attn(h, cos_sin, meta, cache)
        x = x + h * self.residual_multiplier
        return x + self.mlp(self.post_attention_layernorm(x)) * self.residual_multiplier


class GraniteMoeHybridForCausalLM(StatefulHybrid, GraniteForCausalLM):
    state_layers_name = "Mamba2 layers"
    variant = DecoderVariant(attention_multiplier=True, mlp_bias=False)
    layer_cls = GraniteHybridLayer

    def __init__(self, config: Any) -> None:
        types = list(getattr(config, "layer_types", None) or [])
        if len(types) != config.num_hidden_layers or set(types) - _MAMBA - _ATTENTION:
            raise ValueError(f"layer_types must name 'mamba' or 'attention' for each of the {config.num_hidden_layers} "
                             f"layers, got {types}")  # fmt: skip
        if not set(types) & _ATTENTION:
            raise ValueError("layer_types has no 'attention' layer; vllmini needs at least one")
        kind = getattr(config, "position_embedding_type", None)
        if kind not in (None, "nope", "rope"):
            raise ValueError(f"position_embedding_type {kind!r} is not supported; supported: 'rope', 'nope' (or none)")
        super().__init__(config)
        for layer, kind in zip(self.model.layers, types):
            if kind in _MAMBA:
                layer.make_mamba(config)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        c = self.config
        if int(getattr(c, "num_local_experts", 0) or 0) > 0:
            return SharedMLPMoE(c)
        return GatedMLP(c.hidden_size, c.shared_intermediate_size, act=getattr(c, "hidden_act", "silu"))

    @property
    def dense(self) -> bool:
        return not int(getattr(self.config, "num_local_experts", 0) or 0)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's names: ``block_sparse_moe.*`` as GraniteMoe's, ``shared_mlp.*`` into our gated MLP."""
        return super().load_weights((self._our_name(name), t) for name, t in weights)

    def _our_name(self, name: str) -> str:
        layer, sep, leaf = name.partition(".shared_mlp.")
        if sep:
            leaf = {"input_linear.weight": "gate_up_proj.weight", "output_linear.weight": "down_proj.weight"}.get(leaf, leaf)
            return f"{layer}.mlp.{leaf}" if self.dense else f"{layer}.mlp.shared_mlp.{leaf}"
        return _moe_name(name)

    def checkpoint_names(self, param: str) -> list[str]:
        layer, sep, leaf = param.partition(".mlp.")
        return [f"{layer}.{_CHECKPOINT_NAMES[leaf]}"] if sep and leaf in _CHECKPOINT_NAMES else super().checkpoint_names(param)

    def scale_prompt_embeds(self, values: torch.Tensor) -> torch.Tensor:
        """Granite's ``embedding_multiplier`` applies to prompt_embeds too."""
        return values * float(self.config.embedding_multiplier)

