"""Chat messages -> a prompt through the tokenizer's chat template, for ``LLM.chat``,
``AsyncLLMEngine.generate`` and the CLI's chat alike.

Messages may carry OpenAI-style content parts (``[{"type": "text", "text": ...}]``); most
templates (SmolLM2's, Qwen's) expect a string, so the text parts are joined with newlines
first, as vLLM does for such templates (``content_format="openai"`` keeps them as a list of
``{"type": "text", "text": ...}`` for templates that loop over the parts). A message without
content (an assistant turn that only calls tools) gets "", as in vLLM, and its tool calls'
``arguments`` (JSON text in OpenAI's messages) are parsed into dicts for the template, as vLLM
does. The prompt keeps the templated text, which ``RequestOutput.prompt`` reports.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from vllmini.engine.skip_tokenizer import no_tokenizer
from vllmini.files import read_if_file

Message = dict[str, Any]

# vLLM's text-like content parts, and the key holding each one's text
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}
CONTENT_FORMATS = ("auto", "string", "openai")
# vLLM's image, video and audio content parts (chat and Responses): refused by name, as text-only serving
MEDIA_PARTS = ("image_url", "input_image", "image", "image_pil", "image_embeds", "video_url", "video", "audio_url",
               "input_audio", "audio", "audio_embeds", "file", "input_file")  # fmt: skip
TEXT_ONLY = ("vllmini serves text only (a multimodal checkpoint's language model, without its vision or audio "
             "encoder)")  # fmt: skip


def media_part_error(where: str, kind: str) -> ValueError:
    """The refusal of an image, video or audio content part at ``where`` (a message's content part)."""
    return ValueError(f"{where}: {kind!r} parts are not accepted: {TEXT_ONLY}; send the content as text parts")


def render_chat(
    tokenizer: Any, messages: Sequence[Message], content_format: str = "string", **options: Any
) -> dict[str, Any]:
    """``{"prompt": templated text, "prompt_token_ids": its tokens}`` for one conversation.
    ``options`` reach ``apply_chat_template`` (add_generation_prompt, chat_template, tools, ...).
    Raises ValueError naming the message or option at fault."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"messages must be a non-empty list of dicts, got {messages!r}")
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of {CONTENT_FORMATS}, got {content_format!r}")
    options["chat_template"] = resolve_chat_template(tokenizer, options.get("chat_template"))
    flat = [_flatten(i, msg, as_parts=content_format == "openai") for i, msg in enumerate(messages)]
    try:
        text = tokenizer.apply_chat_template(flat, **{**options, "tokenize": False})
    except ValueError:
        raise
    except Exception as exc:  # as vLLM: a template's own error (raise_exception, bad syntax) is a ValueError
        raise ValueError(f"the chat template failed: {type(exc).__name__}: {exc}") from exc
    # what apply_chat_template(tokenize=True) does: the template writes the special tokens itself
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return {"prompt": text, "prompt_token_ids": list(ids)}


def resolve_chat_template(tokenizer: Any, chat_template: str | None) -> str | None:
    """The template to render with: ``chat_template`` as Jinja text, the name of one of the
    tokenizer's templates, or (as vLLM's ``--chat-template``) the path of a file holding one;
    None: the tokenizer's own. Refused, naming the tokenizer, where there is none (transformers
    would otherwise apply no default), and a path-like string naming no file is refused too,
    instead of being rendered as the literal prompt."""
    if tokenizer is None:
        raise no_tokenizer("a chat template (chat messages)")
    if chat_template is None:
        if tokenizer.chat_template is None:
            raise ValueError(
                f"the tokenizer of {tokenizer.name_or_path!r} has no chat template: pass chat_template= "
                "(a Jinja template or the path of a .jinja file), or prompt with generate() instead"
            )
        return None
    if not isinstance(chat_template, str):
        raise ValueError(f"chat_template must be a string, got {type(chat_template).__name__}")
    named = tokenizer.chat_template if isinstance(tokenizer.chat_template, dict) else {}
    if chat_template in named or any(c in chat_template for c in "{}\n"):
        return chat_template
    if (text := read_if_file(chat_template)) is None:
        raise ValueError(f"chat_template {chat_template!r} is neither a Jinja template nor an existing file")
    return text


def message_text(msg: Message) -> str:
    """A (checked) message's content as the template sees it: its text parts joined with newlines."""
    return _flatten(0, msg)["content"]


def _flatten(i: int, msg: Any, as_parts: bool = False) -> Message:
    """The message with its content as one string (or, ``as_parts``, a list of text parts);
    other keys are untouched."""
    if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
        raise ValueError(f"messages[{i}] must be a dict with a string 'role', got {msg!r}")
    content = msg.get("content")
    if content is None:  # vLLM: a message without content renders as ""
        content = []
    elif isinstance(content, str):
        content = [content]
    elif not isinstance(content, list):
        raise ValueError(f"messages[{i}].content must be a string or a list of parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind in MEDIA_PARTS:
            raise media_part_error(f"messages[{i}].content[{j}]", kind)
        if kind not in TEXT_PARTS:
            raise ValueError(f"messages[{i}].content[{j}]: only text parts are supported, got {kind!r}")
        key = TEXT_PARTS[kind]
        if not isinstance(part.get(key), str):
            raise ValueError(f"messages[{i}].content[{j}].{key} must be a string, got {part.get(key)!r}")
        texts.append(part[key])
    flat = {**msg, "content": [{"type": "text", "text": t} for t in texts] if as_parts else "\n".join(texts)}
    if msg["role"] == "assistant":
        _assistant_fields(i, flat)
    return flat


def _assistant_fields(i: int, msg: Message) -> None:
    """As vLLM hands them to templates: each tool call's ``arguments`` (OpenAI's JSON text) as a
    dict, which templates iterate or write with ``tojson``; an empty ``tool_calls`` left out;
    the reasoning under both of vLLM's names (Qwen3's template reads ``reasoning_content``)."""
    calls = msg.get("tool_calls")
    if isinstance(calls, list) and not calls:
        del msg["tool_calls"]
    elif isinstance(calls, list):
        msg["tool_calls"] = [_tool_call(i, j, call) for j, call in enumerate(calls)]
    elif calls is not None:  # (a template would iterate a string's characters or a dict's keys)
        raise ValueError(f"messages[{i}].tool_calls must be a list of tool calls, got {type(calls).__name__}")
    reasoning = msg.get("reasoning", msg.get("reasoning_content"))
    if isinstance(reasoning, str):
        msg["reasoning"] = msg["reasoning_content"] = reasoning


def _tool_call(i: int, j: int, call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise ValueError(f"messages[{i}].tool_calls[{j}].function must be an object with a name and arguments")
    arguments = function.get("arguments")
    if arguments is None or arguments == "":
        arguments = {}  # (as vLLM)
    elif isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as exc:
            raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON: {exc}") from None
    elif not isinstance(arguments, (dict, list)):
        raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments must be JSON text, got {arguments!r}")
    return {**call, "function": {**function, "arguments": arguments}}
