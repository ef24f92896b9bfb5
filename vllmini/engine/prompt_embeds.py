"""Prompts given as embeddings (vLLM's ``EmbedsPrompt``): ``{"prompt_embeds": tensor}`` with an
engine started with ``enable_prompt_embeds=True``.

The tensor ``[num_tokens, hidden_size]`` (or ``[1, num_tokens, hidden_size]``) stands for the
prompt's input embeddings: what the model's embedding table would give for token ids, or
anything else of that width (soft prompts, another model's projections). The sequence carries
it and placeholder token ids (0) of the same length; the forward replaces the embedding rows of
the scheduled prompt positions with it (chunked prefill and recompute after preemption take the
slice they need). Generated tokens are ordinary ids, embedded by the model.

What reads prompt token ids sees none (``Sequence.known_prompt_ids``): repetition penalties count
only the output, as vLLM's. The prefix cache keys the blocks by a digest of the embeddings (folded
into the request's cache salt), so two requests share blocks only when their embeddings are equal.
The outputs' ``prompt_token_ids`` and ``prompt`` are None, as vLLM's. Not available with them:
``prompt_logprobs`` (no tokens to score), beam search, the pooling runner and speculative decoding.
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch

PLACEHOLDER_ID = 0  # the token id a prompt embedding's position carries (never embedded)


def check_prompt_embeds(value: Any, hidden_size: int) -> torch.Tensor:
    """The prompt's embeddings as a contiguous float32 CPU tensor ``[L, hidden_size]``; a
    ValueError names ``prompt_embeds`` and what is wrong."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"prompt_embeds must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() == 3 and value.shape[0] == 1:  # (a batch of one, as vLLM accepts)
        value = value[0]
    if value.dim() != 2 or value.shape[-1] != hidden_size:
        raise ValueError(f"prompt_embeds must have shape [num_tokens, {hidden_size}] (the model's hidden size), "
                         f"got {list(value.shape)}")  # fmt: skip
    if not value.is_floating_point():
        raise ValueError(f"prompt_embeds must be a floating-point tensor, got {value.dtype}")
    if value.shape[0] == 0:
        raise ValueError("prompt_embeds is empty: at least one position is needed")
    value = value.detach().to("cpu", torch.float32).contiguous()
    if not torch.isfinite(value).all():
        raise ValueError("prompt_embeds contains NaN or infinite values")
    return value


def salted(embeds: torch.Tensor, cache_salt: str | None) -> str:
    """The cache salt that keeps a prompt's blocks apart from every prompt with other embeddings
    (and from token prompts, whose placeholder ids would otherwise match)."""
    digest = hashlib.sha256(embeds.numpy().tobytes()).hexdigest()
    return f"{cache_salt or ''}\x00prompt_embeds:{digest}"


def stacked(chunks: list[tuple[int, torch.Tensor]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's embedding chunks (first row in the flat batch, ``[n, hidden]``) as the forward's
    ``inputs_embeds``: (row indices, values), on ``device``."""
    rows = torch.cat([torch.arange(row, row + len(values)) for row, values in chunks])
    values = torch.cat([values for _, values in chunks])
    return rows.to(device), values.to(device)
