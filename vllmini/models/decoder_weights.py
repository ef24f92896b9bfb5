"""Loading a decoder's HF checkpoint (``LlamaForCausalLM`` and every model built on it): q/k/v and
gate/up shards into their fused parameters, experts into their stacked tensors, a model's own
``checkpoint_renames`` applied on the way; and the names a missing parameter has in the checkpoint,
for the loader's error."""
from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
from torch import nn

from vllmini.models.moe import expert_tensor, expert_tensor_name, fused_expert_tensor

logger = logging.getLogger("vllmini")

# checkpoint projection -> (fused parameter, shard index)
_STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # fmt: skip
SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}  # fused -> its shards
# rotary tables some exporters save (ColossalAI: cos/sin caches); RoPE is recomputed from the config, as in vLLM
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class DecoderWeights:
    """The loading half of ``LlamaForCausalLM`` (a mixin: it reads ``model``, ``lm_head``, ``config``, ``tied``)."""

    model: Any
    lm_head: nn.Linear
    config: Any
    tied: bool
    fused_checkpoint = False  # True: checkpoints hold qkv_proj / gate_up_proj fused (Phi-3)
    expert_projections = ("gate_proj", "up_proj", "down_proj")  # a mixture of experts' names (models/moe.py)
    # (checkpoint's, ours) name parts, replaced in order as tensors load; swapped for the loader's errors
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    _shards_seen: dict[str, set]  # fused parameter -> shards loaded (set by __init__, then by each load_weights)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our (fused) parameters; returns the parameter names filled.

        A fused parameter counts as loaded once all its shards are."""
        params = dict(self.named_parameters())
        shards_seen = self._shards_seen = {}
        loaded: set[str] = set()
        tied_head = None  # a tied checkpoint's own lm_head.weight, checked against the embedding below
        for name, tensor in weights:
            name = _renamed(name, self.checkpoint_renames)
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.tied:
                tied_head = tensor
                continue
            module_path, _, leaf = name.rpartition(".")
            parent, _, proj = module_path.rpartition(".")
            if (expert := expert_tensor(name, self.expert_projections)) is not None:
                path, stacked, index, shard = expert  # e.g. model.layers.0.mlp.experts, w13, 5, 1
                experts, target = self.get_submodule(path), f"{path}.{stacked}"
                copy_into(experts.slot(stacked, index, shard), tensor, name)
                shards_seen.setdefault(target, set()).add((index, shard))
                if len(shards_seen[target]) == len(experts.shards(stacked)):
                    loaded.add(target)
            elif (fused := fused_expert_tensor(name)) is not None:  # every expert at once (transformers >= 5)
                target = ".".join(fused)
                copy_into(self._param(params, target, name).data, tensor, name)
                shards_seen[target] = set(self.get_submodule(fused[0]).shards(fused[1]))
                loaded.add(target)
            elif proj in _STACKED:
                fused, shard = _STACKED[proj]
                target = f"{parent}.{fused}.{leaf}"
                param = self._param(params, target, name)
                sizes = self._shard_sizes(fused, param.shape[0])
                offset = sum(sizes[:shard])
                copy_into(param.data[offset : offset + sizes[shard]], tensor, name)
                shards_seen.setdefault(target, set()).add(shard)
                if len(shards_seen[target]) == len(sizes):
                    loaded.add(target)
            else:
                copy_into(self._param(params, name, name).data, tensor, name)
                loaded.add(name)
        if tied_head is not None and "model.embed_tokens.weight" in loaded:
            self._untie_if_different(tied_head, loaded)
        return loaded

    def checkpoint_names(self, param: str) -> list[str]:
        """The checkpoint tensors that would fill ``param`` and were not found (for the loader's error):
        the missing q/k/v or gate/up shards of a fused parameter, else the parameter's own name."""
        back = tuple((ours, theirs) for theirs, ours in self.checkpoint_renames)
        return [_renamed(name, back) for name in self._unfilled_names(param)]

    def _unfilled_names(self, param: str) -> list[str]:
        module_path, _, leaf = param.rpartition(".")
        parent, _, fused = module_path.rpartition(".")
        if fused == "experts":
            seen = self._shards_seen.get(param, set())
            missing = [s for s in self.get_submodule(module_path).shards(leaf) if s not in seen]
            return [expert_tensor_name(param, e, shard, self.expert_projections) for e, shard in missing]
        if fused not in SHARDS or self.fused_checkpoint:
            return [param]
        seen = self._shards_seen.get(param, set())
        return [f"{parent}.{proj}.{leaf}" for i, proj in enumerate(SHARDS[fused]) if i not in seen]

    def _untie_if_different(self, head: torch.Tensor, loaded: set[str]) -> None:
        """tie_word_embeddings with an lm_head.weight that is not the embedding: transformers then
        unties them and uses the checkpoint's lm_head; so do we (an equal copy stays tied)."""
        embed = self.model.embed_tokens.weight
        if tuple(head.shape) == tuple(embed.shape) and torch.equal(head.to(embed.device, embed.dtype), embed.data):
            return
        logger.warning("tie_word_embeddings is set but lm_head.weight differs from the embedding: using it untied")
        self.lm_head.weight = nn.Parameter(torch.empty_like(embed), requires_grad=False)
        copy_into(self.lm_head.weight.data, head, "lm_head.weight")
        self.config.tie_word_embeddings = False
        loaded.add("lm_head.weight")

    def _shard_sizes(self, fused: str, total: int) -> list[int]:
        if fused == "gate_up_proj":
            return [total // 2, total // 2]
        attn = self.model.layers[0].self_attn
        return [attn.q_size, attn.kv_size, attn.kv_size]

    @staticmethod
    def _param(params: dict[str, nn.Parameter], target: str, source: str) -> nn.Parameter:
        if target not in params:
            raise ValueError(f"checkpoint tensor {source!r} has no matching parameter in the model (architecture mismatch?)")
        return params[target]


def copy_into(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(src.shape)} but config.json implies {tuple(dst.shape)}"
        )
    dst.copy_(src)


def _renamed(name: str, pairs: tuple[tuple[str, str], ...]) -> str:
    for old, new in pairs:
        name = name.replace(old, new)
    return name
