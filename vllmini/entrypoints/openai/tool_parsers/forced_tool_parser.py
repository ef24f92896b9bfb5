"""The calls of a forced ``tool_choice``, whose output structured outputs shaped (as vLLM does):

- a named function (``{"type": "function", "function": {"name": ...}}``): the output IS the
  call's arguments (its parameters' JSON schema), taken as the model wrote them (as vLLM);
- ``"required"``: the output is a JSON array of ``{"name": ..., "parameters": {...}}``, one
  per call (tool_choice.py's schema), each call's arguments written as
  ``json.dumps(parameters, ensure_ascii=False)`` (as vLLM).
"""
from __future__ import annotations

from typing import Any

from vllmini.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser


class NamedToolParser(ToolParser):
    def __init__(self, tokenizer: Any = None, name: str = "") -> None:
        super().__init__(tokenizer)
        self.name = name

    def fresh(self) -> NamedToolParser:
        return NamedToolParser(self.tokenizer, self.name)

    def _read(self, text: str) -> None:
        if self._started == 0:
            self._started = 1
            self._out.append(("call", 0, self.name))
        if text:
            self._out.append(("args", 0, text))

    def _finish(self) -> None:
        self._read("")


class RequiredToolParser(ToolParser):
    """The output is one JSON array of calls (the base's array reading); nothing may follow it."""

    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._begin_call("", array=True)

    def _step(self) -> bool:
        self._buf = ""  # (after the array)
        return False
