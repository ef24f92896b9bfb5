"""What a classifier's logits go through before they are reported, as vLLM reads it from the
checkpoint's config.json (vLLM's ``use_activation=False`` skips it and reports the logits).

- classify, as transformers' loss for the config's ``problem_type``: "regression" none,
  "multi_label_classification" a sigmoid per label, else (single label, or unset) a softmax over
  the labels, or a sigmoid when there is only one label (a cross-encoder's relevance logit).
- score (a cross-encoder's pair): sentence-transformers' ``activation_fn`` (config.json's
  ``sentence_transformers.activation_fn`` or ``sbert_ce_default_activation_function``) when one is
  named, else softmax over the labels (sigmoid for one).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

Activation = Callable[[torch.Tensor], torch.Tensor]


def _identity(logits: torch.Tensor) -> torch.Tensor:
    return logits


def _softmax_or_sigmoid(logits: torch.Tensor) -> torch.Tensor:
    """vLLM's default: softmax over the labels; a single label's logit through a sigmoid."""
    return torch.sigmoid(logits) if logits.shape[-1] < 2 else torch.softmax(logits, dim=-1)


# sentence-transformers' activation_fn (a torch.nn.modules class) -> what it computes
_SBERT_FUNCTIONS: dict[str, Activation] = {
    "torch.nn.modules.linear.Identity": _identity,
    "torch.nn.modules.activation.Sigmoid": _softmax_or_sigmoid,  # (vLLM: Sigmoid and Softmax both)
    "torch.nn.modules.activation.Softmax": _softmax_or_sigmoid,
    "torch.nn.modules.activation.Tanh": torch.tanh,
}


def classifier_activation(hf_config: Any, task: str) -> Activation:
    """The activation of ``task`` ("classify" or "score") for the model ``hf_config`` describes;
    an activation function the config names but that is not built here is refused, naming it."""
    if task == "classify":
        problem_type = getattr(hf_config, "problem_type", None)
        if problem_type == "regression":
            return _identity
        if problem_type == "multi_label_classification":
            return torch.sigmoid
        return _softmax_or_sigmoid
    sbert = getattr(hf_config, "sentence_transformers", None)
    name = sbert.get("activation_fn") if isinstance(sbert, dict) else None
    field = "sentence_transformers.activation_fn"
    if name is None:
        field = "sbert_ce_default_activation_function"
        name = getattr(hf_config, field, None)
    if name is None:
        return _softmax_or_sigmoid
    if name not in _SBERT_FUNCTIONS:
        raise ValueError(f"config.json {field}={name!r} is not supported; supported: {sorted(_SBERT_FUNCTIONS)}")
    return _SBERT_FUNCTIONS[name]
