"""The Responses API's request (``POST /v1/responses``), as vLLM's ``ResponsesRequest``, and its
translation into a chat request: the input items become chat messages, ``text.format`` the
``response_format``, the flat function tools the chat's ``tools``, so that one path (the chat
template, structured outputs, the tool and reasoning parsers) serves both routes.

A bad item, role or field is a ValueError naming it (``input[1].role``...), a 400.
"""
from __future__ import annotations

from typing import Any

import msgspec

from vllmini.engine.chat import MEDIA_PARTS, media_part_error
from vllmini.engine.sampling_params import StructuredOutputsParams
from vllmini.entrypoints.openai.protocol import ChatCompletionRequest, JsonSchemaFormat, ResponseFormat, Seed

ROLES = ("user", "system", "developer", "assistant")
LOGPROBS = "message.output_text.logprobs"  # the one ``include`` value served
TEXT_PART_TYPES = ("input_text", "output_text", "text")
# the sampling fields vLLM's ResponsesRequest takes, handed to the chat request as they are
_PASSED = ("temperature", "top_p", "top_k", "repetition_penalty", "seed", "stop", "ignore_eos", "logit_bias",
           "skip_special_tokens", "include_stop_str_in_output", "structured_outputs", "priority", "user")  # fmt: skip


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/responses``: OpenAI's fields, then vLLM's extras."""

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None  # a system message first (not carried over by previous_response_id)
    max_output_tokens: int | None = None  # left out: to the end of the context
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    tools: list[dict[str, Any]] = []
    tool_choice: str | dict[str, Any] | None = None  # left out: "auto" (with tools)
    parallel_tool_calls: bool = True
    reasoning: dict[str, Any] | None = None  # {"effort": "none"} turns a template's thinking off (as vLLM)
    include: list[str] | None = None  # ["message.output_text.logprobs"]: the output text's logprobs
    top_logprobs: int | None = None  # with them, the most likely tokens at each position
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    background: bool = False  # refused: not built
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str = "auto"
    truncation: str = "disabled"
    # vLLM's extras
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    structured_outputs: StructuredOutputsParams | None = None
    priority: int = 0
    request_id: str | None = None

    def check(self) -> None:
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be at least 1, got {self.max_output_tokens}")
        if self.background:
            raise ValueError("background: background responses are not supported by this server")
        if self.truncation not in ("disabled", "auto"):
            raise ValueError(f"truncation must be 'disabled' or 'auto', got {self.truncation!r}")
        if self.truncation == "auto":
            raise ValueError("truncation 'auto' is not supported: the input must fit in the context")
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input must be a string or a non-empty list of items")
        if unknown := [name for name in self.include or [] if name != LOGPROBS]:
            raise ValueError(f"include: only {LOGPROBS!r} is supported, got {unknown!r}")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be between 0 and 20, got {self.top_logprobs}")

    @property
    def output_logprobs(self) -> bool:
        return LOGPROBS in (self.include or [])

    def input_messages(self) -> list[dict[str, Any]]:
        """The ``input`` as chat messages (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for i, item in enumerate(self.input):
            add_item(messages, item, f"input[{i}]")
        return messages

    def to_chat(self, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request of these messages with this request's sampling, format and tools."""
        given = {name: v for name in _PASSED if (v := getattr(self, name)) is not None}
        tools = [chat_tool(i, tool) for i, tool in enumerate(self.tools)] or None
        effort = (self.reasoning or {}).get("effort")
        kwargs = None if effort is None else {"enable_thinking": effort != "none"}
        return ChatCompletionRequest(
            messages=messages, model=self.model, max_completion_tokens=self.max_output_tokens, stream=self.stream,
            response_format=self._response_format(), tools=tools, tool_choice=self._tool_choice(tools),
            parallel_tool_calls=self.parallel_tool_calls, chat_template_kwargs=kwargs, logprobs=self.output_logprobs,
            top_logprobs=self.top_logprobs if self.output_logprobs else None, **given,
        )  # fmt: skip

    def _response_format(self) -> ResponseFormat | None:
        """``text.format`` as a chat ``response_format`` (Responses puts the schema's fields flat)."""
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
        if kind != "json_schema":
            return ResponseFormat(type=kind)
        if not isinstance(fmt.get("schema"), dict):
            raise ValueError("text.format.schema is required (a JSON schema object) when text.format.type is 'json_schema'")
        return ResponseFormat(type=kind, json_schema=JsonSchemaFormat(name=fmt.get("name"), schema=fmt["schema"],
                                                                      strict=fmt.get("strict")))  # fmt: skip

    def _tool_choice(self, tools: list[dict[str, Any]] | None) -> str | dict[str, Any] | None:
        """Responses' ``{"type": "function", "name": ...}`` in the chat's shape; "auto" and "none"
        without tools are what leaving it out means."""
        choice = self.tool_choice
        if choice is None or tools is None and choice in ("auto", "none"):
            return None
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "name": '
                                 f'"my_function"}}, got {choice!r}')  # fmt: skip
            return {"type": "function", "function": {"name": choice["name"]}}
        return choice


def chat_tool(i: int, tool: Any) -> dict[str, Any]:
    """A Responses function tool (``{"type": "function", "name", "parameters", ...}``, or the chat
    shape, which vLLM takes too) as a chat tool."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise ValueError(f"tools[{i}].type: only function tools are supported, got {kind!r}")
    if isinstance(tool.get("function"), dict):
        return tool
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise ValueError(f"tools[{i}].name is required (a non-empty string)")
    function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def add_item(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    """Append one input item to the chat messages: a message, a function call (an assistant
    message's tool call, joined to the assistant message before it) or a call's output (a tool
    message); reasoning items are left out, as vLLM leaves earlier reasoning out."""
    if not isinstance(item, dict):
        raise ValueError(f"{where} must be an object (an input item), got {item!r}")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
        messages.append({"role": role, "content": _content(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        call = {name: _string(item, name, where) for name in ("call_id", "name", "arguments")}
        tool_call = {"id": call["call_id"], "type": "function",
                     "function": {"name": call["name"], "arguments": call["arguments"]}}  # fmt: skip
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(tool_call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [tool_call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                         "content": _content(item.get("output"), f"{where}.output")})  # fmt: skip
    elif kind != "reasoning":
        raise ValueError(f"{where}.type: unknown input item type {kind!r} (supported: message, function_call, "
                         "function_call_output, reasoning)")  # fmt: skip


def _string(item: dict[str, Any], name: str, where: str) -> str:
    if not isinstance(item.get(name), str):
        raise ValueError(f"{where}.{name} is required (a string), got {item.get(name)!r}")
    return item[name]


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content: a string or a list of text parts (kept for the chat template)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of input_text parts, got {content!r}")
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise media_part_error(f"{where}[{j}].type", kind)
        if kind not in TEXT_PART_TYPES:
            raise ValueError(f"{where}[{j}].type: only text parts (input_text, output_text) are supported, got {kind!r}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}].text is required (a string)")
    return content
