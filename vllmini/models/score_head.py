"""The head of a ``*ForSequenceClassification`` checkpoint: transformers' ``score`` linear layer
(hidden size -> num_labels, no bias), which the pooling runner applies to the pooled hidden state;
a ``*ForTokenClassification``'s is the same layer with a bias (transformers' default), applied to
every token's hidden state.

It is kept in float32 whatever the model's dtype (vLLM's ``head_dtype`` default for classifier
heads: a bf16 body's logits are then not rounded once more), and it is not an ``nn.Linear`` so
that the CPU's oneDNN prepacking (models/packed_linear.py) leaves it alone."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ScoreHead(nn.Module):
    def __init__(self, hidden_size: int, num_labels: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_labels, hidden_size, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_labels, dtype=torch.float32), requires_grad=False) if bias else None

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        """``pooled`` [..., hidden] (any float dtype) -> float32 logits [..., num_labels]."""
        return F.linear(pooled.float(), self.weight, self.bias)
