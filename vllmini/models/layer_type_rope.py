"""Rotary tables by kind of layer, for models whose sliding-window layers turn at another rate than
their full-attention ones (Gemma 3; OLMo 3, where transformers 5 keeps one ``rope_parameters`` set
per layer type, so that a rope scaling can reach the full layers alone)."""
from __future__ import annotations

from typing import Any, Callable

import torch

from vllmini.models.rotary import RotaryEmbedding, rope_parameters


class RopeByLayerType:
    """A mixin for ``LlamaForCausalLM`` subclasses: ``init_layer_type_rope`` in ``__init__``, then
    ``rope_tables`` hands each layer its kind's cos/sin."""

    config: Any
    model: Any
    head_dim: int
    variant: Any

    def init_layer_type_rope(self, params: Callable[[Any, str], dict[str, Any]] = rope_parameters) -> None:
        """``params(config, layer_type)``: the rope settings of that kind of layer."""
        interleaved = self.variant.rope_interleaved
        self.model.rotary_emb = RotaryEmbedding(self.head_dim, params(self.config, "full_attention"), interleaved)
        self.model.rotary_emb_local = RotaryEmbedding(self.head_dim, params(self.config, "sliding_attention"), interleaved)
        types = getattr(self.config, "layer_types", None) or ["full_attention"] * self.config.num_hidden_layers
        self.local_rope = [kind == "sliding_attention" for kind in types]  # (kept under disable_sliding_window)

    def rope_tables(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        full = self.model.rotary_emb.cos_sin(positions)
        local = self.model.rotary_emb_local.cos_sin(positions) if any(self.local_rope) else full
        return [local if slides else full for slides in self.local_rope]
