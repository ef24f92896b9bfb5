"""Qwen3-Next (Qwen3-Next-80B-A3B-Instruct / -Thinking): Qwen3.5-MoE's hybrid decoder
(models/qwen3_5.py) under other checkpoint names and a Qwen2-MoE-style layer plan.

The forward is Qwen3.5's: gated full attention with zero-centred q/k norms and partial rotary
(``partial_rotary_factor``, 0.25 by default), Gated DeltaNet linear layers with their own
gated RMSNorm (a plain weight), zero-centred decoder norms, ``layer_types`` (or, in the
releases' config.json, ``full_attention_interval``, which transformers turns into it). What
differs is only how things are stored and placed:

- Each linear layer's input projections are two fused tensors whose rows are grouped by key
  head: ``in_proj_qkvz`` holds, for each of the ``Hk`` key heads, its q and k rows, then the
  v and z rows of its ``Hv / Hk`` value heads; ``in_proj_ba`` holds, per key head, the b rows
  then the a rows of those value heads. They are regrouped into Qwen3.5's ``in_proj_qkv`` (all
  q, all k, all v: the convolution's channel order), ``in_proj_z``, ``in_proj_b`` and
  ``in_proj_a`` as they load, so that one GatedDeltaNet serves both models.
- The MLP of layer ``i`` has experts (with the sigmoid-gated shared expert) unless ``i`` is in
  ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (a dense MLP of
  ``intermediate_size`` there); top-k weights are renormalised as ``norm_topk_prob`` says.
- The multi-token-prediction layer (``mtp.*``) is skipped, as for Qwen3.5.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from vllmini.models.moe import is_sparse_layer, qwen_moe_block
from vllmini.models.qwen3_5 import Qwen3_5ForCausalLM

_QKVZ, _BA = "linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"
# our split parameters -> the fused checkpoint tensor they come from (for the missing-tensor error)
_FUSED_SOURCE = {"in_proj_qkv": _QKVZ, "in_proj_z": _QKVZ, "in_proj_b": _BA, "in_proj_a": _BA}


def split_qkvz(weight: torch.Tensor, num_k_heads: int, head_k_dim: int, group_v_dim: int,
               name: str) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``in_proj_qkvz`` rows (per key head: q, k, v, z) as ``(in_proj_qkv, in_proj_z)`` rows (all q,
    all k, all v; all z). ``group_v_dim``: the rows of one key head's value heads (``Hv/Hk * Dv``)."""
    per_head = 2 * head_k_dim + 2 * group_v_dim
    if weight.dim() != 2 or weight.shape[0] != num_k_heads * per_head:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(weight.shape)} but config.json implies "
                         f"({num_k_heads * per_head}, hidden_size)")  # fmt: skip
    q, k, v, z = weight.view(num_k_heads, per_head, -1).split([head_k_dim, head_k_dim, group_v_dim, group_v_dim], 1)
    rows = weight.shape[1]
    return torch.cat([q.reshape(-1, rows), k.reshape(-1, rows), v.reshape(-1, rows)]), z.reshape(-1, rows)


def split_ba(weight: torch.Tensor, num_k_heads: int, group_heads: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``in_proj_ba`` rows (per key head: the b rows, then the a rows of its value heads) as
    ``(in_proj_b, in_proj_a)`` rows, one per value head in order."""
    if weight.dim() != 2 or weight.shape[0] != 2 * num_k_heads * group_heads:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(weight.shape)} but config.json implies "
                         f"({2 * num_k_heads * group_heads}, hidden_size)")  # fmt: skip
    b, a = weight.view(num_k_heads, 2 * group_heads, -1).split([group_heads, group_heads], 1)
    return b.reshape(-1, weight.shape[1]), a.reshape(-1, weight.shape[1])


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    def build_mlp(self, layer_idx: int) -> nn.Module:
        c = self.config
        if int(getattr(c, "num_experts", 0) or 0) > 0 and is_sparse_layer(c, layer_idx):
            return qwen_moe_block(c, shared_expert=True)
        return super().build_mlp(layer_idx)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._unfused(weights))

    def _unfused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors with each fused, head-grouped ``in_proj_qkvz`` / ``in_proj_ba``
        split into Qwen3.5's four projections."""
        c = self.config
        hk = c.linear_num_key_heads
        group_heads = c.linear_num_value_heads // hk
        for name, tensor in weights:
            if name.endswith(_QKVZ):
                prefix = name[: -len("in_proj_qkvz.weight")]
                qkv, z = split_qkvz(tensor, hk, c.linear_key_head_dim, group_heads * c.linear_value_head_dim, name)
                yield f"{prefix}in_proj_qkv.weight", qkv
                yield f"{prefix}in_proj_z.weight", z
            elif name.endswith(_BA):
                prefix = name[: -len("in_proj_ba.weight")]
                b, a = split_ba(tensor, hk, group_heads, name)
                yield f"{prefix}in_proj_b.weight", b
                yield f"{prefix}in_proj_a.weight", a
            else:
                yield name, tensor

    def checkpoint_names(self, param: str) -> list[str]:
        """A split linear-layer projection is missing when its fused checkpoint tensor is."""
        parent, _, proj = param.rpartition(".")[0].rpartition(".")
        if proj in _FUSED_SOURCE and parent.endswith("linear_attn"):
            return [parent[: -len("linear_attn")] + _FUSED_SOURCE[proj]]
        return super().checkpoint_names(param)

