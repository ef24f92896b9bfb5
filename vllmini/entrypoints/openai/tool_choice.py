"""A chat request's ``tools`` and ``tool_choice``, checked as vLLM checks them, and the JSON schema
that makes a named or ``"required"`` tool choice through structured outputs (as vLLM does).

``tool_choice`` left out is ``"auto"`` when tools are given (OpenAI's default), else ``"none"``;
``"none"`` still hands the tools to the chat template (vLLM's default, without
``--exclude-tools-when-tool-choice-none``). A bad tool or choice is a ValueError naming the field.
"""
from __future__ import annotations

import copy
from typing import Any, Literal, NamedTuple

from vllmini.engine.errors import VLLMValidationError

NAMED_USAGE = '{"type": "function", "function": {"name": "my_function"}}'


class ToolChoice(NamedTuple):
    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None  # the forced function's, when named


def resolve_tool_choice(tools: list[Any] | None, tool_choice: Any, structured: bool) -> ToolChoice:
    """The request's tool choice, checked. ``structured``: the request has its own structured
    outputs (response_format or structured_outputs), which a forced tool choice cannot share."""
    if tools is not None:
        if not tools:
            raise VLLMValidationError("tools must not be an empty array: give at least one tool or leave the field out",
                                      parameter="tools")
        for i, tool in enumerate(tools):
            _check_tool(i, tool)
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if tool_choice == "none":
        return ToolChoice("none")
    if tools is None:
        raise VLLMValidationError("tool_choice needs tools (when using tool_choice, tools must be set)",
                                  parameter="tool_choice")
    if tool_choice in ("auto", "required"):
        choice = ToolChoice(tool_choice)
    elif isinstance(tool_choice, dict):
        choice = ToolChoice("named", _named(tool_choice, tools))
    else:
        raise VLLMValidationError(f'tool_choice must be "none", "auto", "required" or {NAMED_USAGE}, got {tool_choice!r}',
                                  parameter="tool_choice")
    if structured and choice.mode in ("named", "required"):
        raise VLLMValidationError(f"tool_choice {tool_choice!r} is made with structured outputs: it cannot be combined "
                                  "with response_format or structured_outputs", parameter="tool_choice")  # fmt: skip
    return choice


def _check_tool(i: int, tool: Any) -> None:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise VLLMValidationError(f"tools[{i}].type must be 'function', got {tool!r}", parameter="tools")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise VLLMValidationError(f"tools[{i}].function is required: an object with a name (and parameters)",
                                  parameter="tools")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise VLLMValidationError(f"tools[{i}].function.name is required (a non-empty string)", parameter="tools")
    if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
        raise VLLMValidationError(f"tools[{i}].function.parameters must be a JSON schema (an object)",
                                  parameter="tools")


def _named(tool_choice: dict, tools: list[dict]) -> str:
    if tool_choice.get("type", "function") != "function":
        raise VLLMValidationError(f"tool_choice.type must be 'function': {NAMED_USAGE}", parameter="tool_choice")
    function = tool_choice.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise VLLMValidationError(f"tool_choice.function.name is required: {NAMED_USAGE}", parameter="tool_choice")
    names = [tool["function"]["name"] for tool in tools]
    if function["name"] not in names:
        raise VLLMValidationError(f"tool_choice.function.name {function['name']!r} is not one of the tools "
                                  f"({', '.join(names)})", parameter="tool_choice")
    return function["name"]


def _parameters(tool: dict) -> dict:
    return copy.deepcopy(tool["function"].get("parameters")) or {"type": "object", "properties": {}}


def tool_schema(tools: list[dict], choice: ToolChoice) -> dict | None:
    """The JSON schema the output follows: for a named function its parameters (the output is
    the arguments), for "required" an array of one or more ``{"name", "parameters"}`` objects
    (each tool's ``$defs`` gathered at the top); None for "auto" and "none"."""
    if choice.mode == "named":
        return next(_parameters(tool) for tool in tools if tool["function"]["name"] == choice.name)
    if choice.mode != "required":
        return None
    items, defs = [], {}
    for tool in tools:
        parameters = _parameters(tool)
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise VLLMValidationError(f"tools: the definition {name!r} ($defs) has different schemas in two tools",
                                          parameter="tools")
        items.append({"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                     "parameters": parameters}, "required": ["name", "parameters"]})  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if defs:
        schema["$defs"] = defs
    return schema
