"""vLLM's prompt types (``vllm.inputs``), so that ``from vllm.inputs import TokensPrompt`` ports as
``from vllmini.inputs import TokensPrompt``. They are TypedDicts, plain dicts at run time, holding
the keys vllmini takes (no multi-modal data: vllmini runs text models)."""
from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

from vllmini.engine.input_processor import PromptType

if TYPE_CHECKING:
    import torch


class _PromptOptions(TypedDict, total=False):
    cache_salt: str  # roots the request's prefix-cache blocks apart


class _Text(_PromptOptions, total=False):
    prompt: str  # (with token ids or embeddings: the outputs' prompt text)


class TextPrompt(_PromptOptions):
    prompt: str


class TokensPrompt(_Text):
    prompt_token_ids: list[int]


class EmbedsPrompt(_Text):
    prompt_embeds: torch.Tensor  # (needs enable_prompt_embeds=True)


__all__ = ["TextPrompt", "TokensPrompt", "EmbedsPrompt", "PromptType"]
