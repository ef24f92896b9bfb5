"""What every decoder mixing attention layers with stateful layers shares (Qwen3.5 / Qwen3-Next's
Gated DeltaNet, Granite 4.0's Mamba2, LFM2's short convolutions, Falcon-H1's parallel Mamba2).

Each layer has ``self_attn`` (attention over the paged KV cache), a ``state_mixer`` whose memory
of a sequence is a fixed-size state (kv/state_cache.py), both (Falcon-H1: the two side by side),
or neither (Nemotron-H's MLP-only and MoE layers: no cache at all). Only the layers with attention
have a KV cache and only those with a state mixer a state, so attention layer ``j`` uses
``kv_caches[j]`` and stateful layer ``j`` the state tensors ``meta.state_caches[j]``; a layer with
both gets the pair ``(kv_cache, state)``. The model facts the engine asks of a decoder (heads,
windows, the fused q/k/v split) come from the attention layers, since the first layer may have none.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from vllmini.kv.state_cache import StateShapes
from vllmini.models.attention import KVCache
from vllmini.models.base import AttentionMetadata


class StatefulHybrid:
    """A mixin for a ``LlamaForCausalLM`` subclass whose layers have ``self_attn``, a ``state_mixer``
    (``self_attn`` None), or both."""

    model: Any
    state_layers_name = "linear-attention layers"  # (what the refusals call the stateful layers)

    @property
    def attention_layers(self) -> list[nn.Module]:
        return [layer for layer in self.model.layers if layer.self_attn is not None]

    @property
    def state_mixers(self) -> list[nn.Module]:
        return [mixer for mixer in map(_state_mixer, self.model.layers) if mixer is not None]

    @property
    def num_kv_cache_layers(self) -> int:
        """The layers with a paged KV cache: the attention ones."""
        return len(self.attention_layers)

    def state_shapes(self) -> StateShapes:
        """Each stateful layer's per-sequence state tensors (kv/state_cache.py)."""
        return [mixer.state_shapes() for mixer in self.state_mixers]

    @property
    def sliding_window(self) -> int | None:
        return None

    @property
    def layer_windows(self) -> list[int | None]:
        return [None] * self.num_kv_cache_layers

    @property
    def logits_soft_cap(self) -> float | None:
        return None

    @property
    def attention_sinks(self) -> bool:
        return False

    @property
    def num_kv_heads(self) -> int:
        return self.attention_layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.attention_layers[0].self_attn.head_dim

    def _shard_sizes(self, fused: str, total: int) -> list[int]:
        """The checkpoint's q/k/v (or gate/up) rows in a fused parameter; q's are what k and v leave
        (a gated attention's q_proj gives each head its query and its gate)."""
        if fused == "gate_up_proj":
            return [total // 2, total // 2]
        attn = self.attention_layers[0].self_attn
        return [total - 2 * attn.kv_size, attn.kv_size, attn.kv_size]

    def lora_targets(self) -> list[tuple[str, list[str], list[int]]]:
        raise ValueError(f"LoRA adapters are not supported for {type(self).__name__} ({self.state_layers_name})")

    def cuda_graph_blocker(self, device: torch.device, dtype: torch.dtype) -> str | None:
        return f"{self.state_layers_name} run their states eagerly"

    def set_attention_backend(self, backend: Callable[..., torch.Tensor]) -> None:
        for layer in self.attention_layers:
            layer.self_attn.attn.backend = backend

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                      kv_caches: list[KVCache] | None = None,
                      inputs_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
        """The final-normed hidden states of the rows in ``logits_indices``: the embedding (``inputs_embeds``'
        rows replaced, through ``scale_prompt_embeds``), every layer with its caches (``run_layers``)."""
        x = self.embed(input_ids)
        if inputs_embeds is not None:
            rows, values = inputs_embeds
            x = x.index_copy(0, rows, self.scale_prompt_embeds(values.to(x.dtype)))
        x = self.run_layers(x, self.rope_tables_for(positions), attn_metadata, kv_caches)
        if attn_metadata.logits_indices is not None:
            x = x.index_select(0, attn_metadata.logits_indices)
        return self.model.norm(x)

    def scale_prompt_embeds(self, values: torch.Tensor) -> torch.Tensor:
        """Prompt embeddings as the first layer takes them: as given (Granite scales them as its tokens')."""
        return values

    def rope_tables_for(self, positions: torch.Tensor) -> Any:
        """The rotary cos/sin every attention layer takes (None for a model without RoPE)."""
        return self.model.rotary_emb.cos_sin(positions)

    def run_layers(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                   kv_caches: list[KVCache] | None) -> torch.Tensor:  # fmt: skip
        """Every layer in order, each with its own caches: the attention layers' K/V, the others'
        states, ``(kv_cache, state)`` for a layer with both."""
        states = meta.state_caches
        attention, stateful = 0, 0
        for layer in self.model.layers:
            kv_cache = state = None
            mixer = _state_mixer(layer)
            if layer.self_attn is not None:
                kv_cache = None if kv_caches is None else kv_caches[attention]
                attention += 1
            if mixer is not None:
                state = None if states is None else states[stateful]
                stateful += 1
            if layer.self_attn is None:
                x = layer(x, cos_sin, meta, state)  # (None for a layer with no cache at all)
            elif mixer is None:
                x = layer(x, cos_sin, meta, kv_cache)
            else:
                x = layer(x, cos_sin, meta, (kv_cache, state))
        return x


def _state_mixer(layer: nn.Module) -> nn.Module | None:
    """A layer's stateful mixer, if it has one (beside its attention or instead of it)."""
    return getattr(layer, "state_mixer", None)
