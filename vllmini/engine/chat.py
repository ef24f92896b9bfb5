"""Chat messages -> a prompt through the tokenizer's chat template, for ``LLM.chat``,
``AsyncLLMEngine.generate`` and the CLI's chat alike.

Messages may carry OpenAI-style content parts (``[{"type": "text", "text": ...}]``); most
templates (SmolLM2's, Qwen's) expect a string, so the text parts are joined with newlines
first, as vLLM does for such templates. The prompt keeps the templated text, which
``RequestOutput.prompt`` reports, as vLLM's does.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Message = dict[str, Any]


def render_chat(tokenizer: Any, messages: Sequence[Message], **options: Any) -> dict[str, Any]:
    """``{"prompt": templated text, "prompt_token_ids": its tokens}`` for one conversation.
    ``options`` reach ``apply_chat_template`` (add_generation_prompt, chat_template, ...).
    Raises ValueError naming the message at fault."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"messages must be a non-empty list of dicts, got {messages!r}")
    flat = [_flatten(i, msg) for i, msg in enumerate(messages)]
    text = tokenizer.apply_chat_template(flat, **{**options, "tokenize": False})
    # what apply_chat_template(tokenize=True) does: the template writes the special tokens itself
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return {"prompt": text, "prompt_token_ids": list(ids)}


def _flatten(i: int, msg: Any) -> Message:
    """The message with list content joined into a string (other keys untouched)."""
    if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
        raise ValueError(f"messages[{i}] must be a dict with a string 'role', got {msg!r}")
    content = msg.get("content")
    if content is None or isinstance(content, str):
        return msg
    if not isinstance(content, list):
        raise ValueError(f"messages[{i}].content must be a string or a list of parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text":
            raise ValueError(f"messages[{i}].content[{j}]: only text parts are supported, got {kind!r}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"messages[{i}].content[{j}].text must be a string, got {part.get('text')!r}")
        texts.append(part["text"])
    return {**msg, "content": "\n".join(texts)}
