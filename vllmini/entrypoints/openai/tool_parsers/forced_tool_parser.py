"""The calls of a forced ``tool_choice``, whose output structured outputs shaped (as vLLM does):

- a named function (``{"type": "function", "function": {"name": ...}}``): the output IS the
  call's arguments (its parameters' JSON schema), taken as the model wrote them (as vLLM);
- ``"required"``: the output is a JSON array of ``{"name": ..., "parameters": {...}}``, one
  per call (tool_choice.py's schema), each call's arguments written as
  ``json.dumps(parameters, ensure_ascii=False)`` (as vLLM).
"""
from __future__ import annotations

from typing import Any

from vllmini.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser, _Call
from vllmini.entrypoints.openai.tool_parsers.json_stream import JsonError, JsonStream


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
    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self._json = JsonStream()
        self._calls: dict[int, _Call] = {}

    def _read(self, text: str) -> None:
        if self._json is None or self._json.done:
            return  # (nothing may follow the array)
        try:
            n, pieces = self._json.feed(text)
            for path, piece in pieces:
                if path:  # (the array's own brackets and commas are not a call's)
                    self._calls.setdefault(path[0], _Call()).take(path[1:], piece)
            for i in sorted(self._calls):
                self._advance(self._calls[i])
            if self._json.done:
                for i in sorted(self._calls):
                    self._end_call(self._calls[i])
        except JsonError as exc:
            self._fall_back(str(exc), text, started=self._started > 0)
            return
        self._raw += text[:n]

    def _finish(self) -> None:
        if self._json is not None and not self._json.done:
            self._fall_back("the output ends inside the tool calls", "", started=self._started > 0)
