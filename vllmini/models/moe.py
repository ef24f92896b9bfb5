"""Mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks each token's top-k
experts, and every expert runs once per step on the rows routed to it.

The experts' weights are stacked (``w13 [E, 2I, H]``: gate then up; ``w2 [E, H, I]``) so that
one grouped matmul runs every expert over its own slice of the token rows, sorted by expert:
no loop over experts in Python and no host sync, so a decode step stays capturable in a CUDA
graph. Where torch has no grouped matmul for the device and dtype (CUDA only has it for
bfloat16; torch before 2.10 not at all), the experts hit run one after another instead. On a
CPU with oneDNN the experts are prepacked after load (models/packed_experts.py) and run one
after another, each a prepacked matmul: faster there than the grouped matmul.
Routing follows transformers: softmax in fp32 over the router logits, top-k, then the k
weights renormalised to sum to one where the model says so (``norm_topk_prob``; Mixtral always).
DeepSeek's routers (models/deepseek.py) override ``FusedMoE.route``: softmax or sigmoid scores, and
``grouped_topk`` below where experts are chosen within the best groups.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from vllmini.models.layers import GatedMLP

if TYPE_CHECKING:
    from vllmini.models.packed_experts import PackedExperts


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """``F.grouped_mm`` (torch >= 2.10) runs any float dtype on CPU, bfloat16 on CUDA (SM80+)."""
    if not hasattr(F, "grouped_mm"):
        return False
    return device.type == "cpu" or (device.type == "cuda" and dtype == torch.bfloat16)


class ExpertWeights(nn.Module):
    """The experts' stacked weights; checkpoints hold one tensor per expert and projection
    (``experts.<e>.gate_proj``...), each copied into its :meth:`slot` (the loader counts them
    against :meth:`shards` until all are in). Once prepacked (CPU, models/packed_experts.py),
    ``w13`` / ``w2`` are None and ``prepacked`` holds them."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        # per-expert biases of gate/up (gate first) and down (gpt-oss), None elsewhere
        self.b13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size), requires_grad=False) if bias else None
        self.b2 = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False) if bias else None
        self.prepacked: PackedExperts | None = None

    def slot(self, param: str, expert: int, shard: int) -> torch.Tensor:
        """Where checkpoint tensor ``(expert, shard)`` of ``param`` ("w13": 0 gate, 1 up; "w2") goes."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint has expert {expert} but config.json says num_experts={self.num_experts}")
        if param == "w2":
            return self.w2.data[expert]
        size = self.intermediate_size
        return self.w13.data[expert, shard * size : (shard + 1) * size]

    def shards(self, param: str) -> list[tuple[int, int]]:
        """Every ``(expert, shard)`` that fills ``param``."""
        return [(e, s) for e in range(self.num_experts) for s in range(2 if param == "w13" else 1)]


class FusedMoE(nn.Module):
    """``num_experts`` gated SiLU MLPs of width ``intermediate_size`` and a linear router ``gate``
    (the checkpoints' names: ``mlp.gate``, ``mlp.experts.<e>.*``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, act: str = "silu") -> None:  # fmt: skip
        super().__init__()
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported; supported: silu")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..num_experts ({num_experts}), got {top_k}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = ExpertWeights(num_experts, hidden_size, intermediate_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k expert ids ``[T, k]`` and their weights ``[T, k]`` (in ``x``'s dtype)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        flat = ids.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        rows = order // self.top_k  # the token of each sorted pair
        counts = torch.bincount(flat, minlength=self.num_experts)
        ys = self.run_experts(x.index_select(0, rows), counts)
        ys = ys * weights.flatten().index_select(0, order)[:, None]
        return torch.zeros_like(x).index_add_(0, rows, ys)

    def run_experts(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Every row of ``xs`` through its expert: rows sorted by expert, ``counts[e]`` of them for expert ``e``."""
        experts = self.experts
        if experts.prepacked is not None:
            return experts.prepacked.run(xs, counts, experts.b13, experts.b2, self.activation)
        h = _grouped_linear(xs, experts.w13, counts)
        if experts.b13 is None:
            return _grouped_linear(self.activation(h), experts.w2, counts)
        # each row's expert, for the biases (output_size given: no host sync, so graph-safe)
        ids = torch.arange(self.num_experts, device=xs.device).repeat_interleave(counts, output_size=xs.shape[0])
        ys = _grouped_linear(self.activation(h + experts.b13.index_select(0, ids)), experts.w2, counts)
        return ys + experts.b2.index_select(0, ids)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The gated activation of the experts' fused gate/up output (SwiGLU)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def grouped_topk(scores: torch.Tensor, top_k: int, num_group: int, topk_group: int,
                 correction_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The ``[T, top_k]`` experts chosen from fp32 ``scores [T, E]`` when only the ``topk_group`` best
    of ``num_group`` equal groups of experts may be picked (DeepSeek's group_limited_greedy and
    noaux_tc; vLLM's ``grouped_topk``). A group's score is its best expert's, or with
    ``correction_bias`` (DeepSeek-V3: added for choosing only) the sum of its best two biased scores."""
    choice = scores if correction_bias is None else scores + correction_bias.float()
    tokens, num_experts = choice.shape
    if num_group > 1:
        grouped = choice.view(tokens, num_group, num_experts // num_group)
        group_scores = grouped.max(-1).values if correction_bias is None else grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1).indices, 1.0)
        hidden = (keep == 0)[:, :, None].expand_as(grouped).reshape(tokens, num_experts)
        # (transformers' V2 fills 0, its V3 -inf: the same choice, scores being positive, unless fewer than
        # top_k experts score above 0 in the kept groups)
        choice = choice.masked_fill(hidden, float("-inf") if correction_bias is not None else 0.0)
    return choice.topk(top_k, dim=-1).indices


def expert_loop(xs: torch.Tensor, rows: list[int], matmul: Callable[[torch.Tensor, int], torch.Tensor],
                out_features: int) -> torch.Tensor:  # fmt: skip
    """``xs`` rows sorted by expert, ``rows[e]`` of them for expert ``e``, each expert's through
    ``matmul(its rows, e)``, in order; experts with no rows are skipped (a host loop: no CUDA graph)."""
    outs, start = [], 0
    for expert, count in enumerate(rows):
        if count:
            outs.append(matmul(xs[start : start + count], expert))
            start += count
    return torch.cat(outs) if outs else xs.new_empty(0, out_features)


def _grouped_linear(xs: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``xs`` rows sorted by expert, ``counts[e]`` of them through ``weight[e]`` (``[E, out, in]``): one
    grouped matmul where torch has one for the device and dtype, else expert after expert."""
    if grouped_mm_supported(xs.device, xs.dtype):
        return F.grouped_mm(xs, weight.transpose(1, 2), offs=counts.cumsum(0).to(torch.int32))
    return expert_loop(xs, counts.tolist(), lambda rows, e: F.linear(rows, weight[e]), weight.shape[1])


class SharedExpertMoE(FusedMoE):
    """Qwen2-MoE's block: the routed experts plus one always-on expert, gated per token by a sigmoid."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool,
                 shared_size: int, act: str = "silu") -> None:  # fmt: skip
        super().__init__(hidden_size, intermediate_size, num_experts, top_k, renormalize, act)
        self.shared_expert = GatedMLP(hidden_size, shared_size, act=act)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return super().forward(x) + shared


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` has experts: Qwen's ``decoder_sparse_step`` and ``mlp_only_layers``
    (Mixtral's configs have neither: every layer)."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and (layer_idx + 1) % step == 0


def qwen_moe_block(config: Any, shared_expert: bool) -> FusedMoE:
    """A Qwen-MoE sparse layer's block as its config describes it: ``moe_intermediate_size`` wide
    experts, top ``num_experts_per_tok`` renormalised per ``norm_topk_prob``; Qwen2-MoE adds its
    shared expert (``shared_expert_intermediate_size``)."""
    args = (config.hidden_size, config.moe_intermediate_size, num_experts(config), config.num_experts_per_tok,
            bool(getattr(config, "norm_topk_prob", False)))  # fmt: skip
    act = getattr(config, "hidden_act", "silu")
    if shared_expert:
        return SharedExpertMoE(*args, config.shared_expert_intermediate_size, act)
    return FusedMoE(*args, act)


def mixtral_moe_block(config: Any) -> FusedMoE:
    """A Mixtral-style block (Mixtral, GraniteMoe): experts ``intermediate_size`` wide in every
    layer, top ``num_experts_per_tok`` renormalised."""
    return FusedMoE(config.hidden_size, config.intermediate_size, num_experts(config), config.num_experts_per_tok,
                    True, getattr(config, "hidden_act", "silu"))  # fmt: skip


def num_experts(config: Any) -> int:
    """Qwen's configs say ``num_experts``, Mixtral's ``num_local_experts``."""
    return int(getattr(config, "num_experts", None) or config.num_local_experts)


_EXPERT_TENSOR = re.compile(r"^(?P<parent>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


def expert_tensor(name: str, projections: tuple[str, str, str]) -> tuple[str, str, int, int] | None:
    """``(ExpertWeights' path, "w13" or "w2", expert, shard)`` for a per-expert checkpoint tensor,
    else None. ``projections``: the checkpoint's names of gate, up and down (Mixtral: w1, w3, w2)."""
    hit = _EXPERT_TENSOR.match(name)
    if hit is None or hit["proj"] not in projections:
        return None
    shard = projections.index(hit["proj"])
    return hit["parent"], "w2" if shard == 2 else "w13", int(hit["expert"]), shard % 2


_FUSED_EXPERTS = re.compile(r"^(?P<parent>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def fused_expert_tensor(name: str) -> tuple[str, str] | None:
    """``(ExpertWeights' path, "w13" or "w2")`` for all experts' weights in one tensor, as transformers
    >= 5 holds them in memory (``experts.gate_up_proj`` [E, 2I, H], gate first; ``experts.down_proj``
    [E, H, I]: our layout), e.g. a trainer's ``state_dict()``; else None."""
    hit = _FUSED_EXPERTS.match(name)
    return None if hit is None else (hit["parent"], "w13" if hit["proj"] == "gate_up_proj" else "w2")


def expert_tensor_name(param: str, expert: int, shard: int, projections: tuple[str, str, str]) -> str:
    """The checkpoint's name of one expert's shard of ``param`` (the inverse of :func:`expert_tensor`)."""
    parent, _, leaf = param.rpartition(".")
    return f"{parent}.{expert}.{projections[2 if leaf == 'w2' else shard]}.weight"
