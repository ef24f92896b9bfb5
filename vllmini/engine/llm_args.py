"""How the offline ``LLM`` reads its calls' per-prompt arguments and vLLM 0.32's
``tokenization_kwargs`` (engine/llm.py, llm_chat.py, llm_pooling.py share them)."""
from __future__ import annotations

from typing import Any


def per_prompt(params: Any, kind: type, name: str, num_prompts: int) -> list[Any]:
    """``params`` as generate / encode take it (one, or None, for every prompt; or one per prompt)."""
    if params is None or isinstance(params, kind):
        return [params] * num_prompts
    params = list(params)
    if len(params) != num_prompts:
        raise ValueError(f"{name} has {len(params)} entries but there are {num_prompts} prompts")
    return params


def tokenization_changes(tokenization_kwargs: dict[str, Any] | None, accepted: tuple[str, ...]) -> dict[str, Any]:
    """vLLM 0.32's ``tokenization_kwargs`` (its overrides of the tokenizer's options) as changes of
    the requests' params: the ``accepted`` keys (``truncate_prompt_tokens``, for pooling also
    ``truncation_side``); vLLM ignores the others with a warning, vllmini refuses them by name."""
    if tokenization_kwargs is None:
        return {}
    if not isinstance(tokenization_kwargs, dict):
        raise ValueError(f"tokenization_kwargs must be a dict or None, got {type(tokenization_kwargs).__name__}")
    if other := sorted(set(tokenization_kwargs) - set(accepted)):
        raise ValueError(f"tokenization_kwargs: {other} not supported (vllmini takes {', '.join(accepted)})")
    return dict(tokenization_kwargs)
