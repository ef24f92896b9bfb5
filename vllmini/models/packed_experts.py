"""A mixture of experts' weights prepacked for oneDNN on the CPU: one packed matrix per expert.

On the CPU ``F.grouped_mm`` (and a loop of ``F.linear``) runs each expert's small matmul on one
thread and through MKL's per-call repacking, the cost models/packed_linear.py removes for the
dense linears. A loop over the experts hit, each a prepacked oneDNN inner product, is faster per
expert matmul (fp32, 32 experts of [1536, 768], 2 threads): 1 row per expert 12.4 -> 8.1 ms,
4 rows 15.8 -> 8.5, 16 rows 17.4 -> 10.9, 64 rows 36.9 -> 28.2; a whole gpt-oss-small MoE layer
(32 experts of [1536, 768], top 4) 1 token 2.40 -> 1.15 ms, 32 tokens 24.3 -> 11.8, 512 tokens
73 -> 49, 2048 tokens 277 -> 222. The loop reads the rows per expert on the host, which costs
nothing on the CPU (no CUDA graphs there).

:func:`prepack_experts` replaces every ``ExpertWeights``' stacked ``w13`` / ``w2`` by their packed
slices and releases the dense parameters (gpt-oss-20b's experts are tens of GB: one copy only);
the biases (gpt-oss) stay dense and go to oneDNN with each expert's matmul. What writes expert
weights after load (live updates, engine/live_weights.py) unpacks them with :func:`unpack_experts`
(``to_dense``: exact) and packs them again; sleep level 2 (engine/worker.py) discards the packed
matrices and brings them back as zeros.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from vllmini.models.moe import ExpertWeights, expert_loop
from vllmini.models.packed_linear import pack_weight, packed_linear


class PackedExperts:
    """``w13[e]`` and ``w2[e]`` of every expert ``e`` in oneDNN's blocked layout (opaque, read-only)."""

    def __init__(self, w13: Iterable[torch.Tensor], w2: Iterable[torch.Tensor]) -> None:
        self.w13 = [pack_weight(w) for w in w13]
        self.w2 = [pack_weight(w) for w in w2]
        self.shape13, self.shape2 = tuple(self.w13[0].shape), tuple(self.w2[0].shape)
        self.num_experts, self.dtype = len(self.w13), self.w13[0].dtype

    def run(self, xs: torch.Tensor, counts: torch.Tensor, b13: torch.Tensor | None, b2: torch.Tensor | None,
            activation: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:  # fmt: skip
        """``FusedMoE.run_experts`` on the packed weights: rows sorted by expert, ``counts[e]`` of them
        for expert ``e``; the experts with no rows are skipped."""
        rows = counts.tolist()
        h = _packed_matmuls(xs, self.w13, rows, b13, self.shape13[0])
        return _packed_matmuls(activation(h), self.w2, rows, b2, self.shape2[0])

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stacked ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``, unpacked (exact)."""
        return torch.stack([w.to_dense() for w in self.w13]), torch.stack([w.to_dense() for w in self.w2])

    def discard(self) -> None:
        """Sleep level 2: the packed matrices given back (the shapes kept for :meth:`zero`)."""
        self.w13, self.w2 = [], []

    def zero(self) -> None:
        """After :meth:`discard`: zeros in every expert, packed (the caller loads weights next)."""
        self.w13 = [pack_weight(torch.zeros(self.shape13, dtype=self.dtype)) for _ in range(self.num_experts)]
        self.w2 = [pack_weight(torch.zeros(self.shape2, dtype=self.dtype)) for _ in range(self.num_experts)]


def _packed_matmuls(xs: torch.Tensor, packed: list[torch.Tensor], rows: list[int], bias: torch.Tensor | None,
                    out_features: int) -> torch.Tensor:  # fmt: skip
    """Each expert's rows of ``xs`` through its packed matrix (and bias), in order."""
    def matmul(x: torch.Tensor, e: int) -> torch.Tensor:
        return packed_linear(x, packed[e], None if bias is None else bias[e])

    return expert_loop(xs, rows, matmul, out_features)


def pack_experts(experts: ExpertWeights) -> None:
    """``experts``' dense ``w13`` / ``w2`` packed and released (the parameters become None)."""
    experts.prepacked = PackedExperts(experts.w13.detach(), experts.w2.detach())
    experts.w13 = experts.w2 = None


def unpack_experts(experts: ExpertWeights) -> None:
    """The inverse of :func:`pack_experts`: dense ``w13`` / ``w2`` parameters again, for a copy into them."""
    w13, w2 = experts.prepacked.dense()
    experts.prepacked = None
    experts.w13, experts.w2 = nn.Parameter(w13, requires_grad=False), nn.Parameter(w2, requires_grad=False)


def prepack_experts(model: nn.Module) -> int:
    """Pack every ``ExpertWeights`` in ``model``; returns how many expert matrices (two per expert)."""
    count = 0
    for module in model.modules():
        if isinstance(module, ExpertWeights) and module.prepacked is None:
            pack_experts(module)
            count += 2 * module.num_experts
    return count
