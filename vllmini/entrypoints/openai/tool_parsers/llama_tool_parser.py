"""``--tool-call-parser llama3_json`` (also ``llama4_json``): Llama 3.x's JSON tool calls, as in
vLLM's tool_chat_template_llama3.1_json.jinja:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

An optional ``<|python_tag|>``, then one or more objects with a ``name`` and ``parameters`` (or
``arguments``), separated by ``;``. An output that does not begin so (after whitespace) is
plain content, as vLLM's streaming parser decides; text after the calls is content.
"""
from __future__ import annotations

from typing import Any

from vllmini.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser


class Llama3JsonToolParser(ToolParser):
    BOT = "<|python_tag|>"

    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        # start (deciding: calls or plain text), after (a call ended), separator (after a ";"),
        # text (content, to the end)
        self._state = "start"

    def _step(self) -> bool:
        head = self._buf.lstrip()
        if self._state == "text":
            self._content(self._buf)
            self._buf = ""
        elif self._state == "start":
            if head.startswith(self.BOT):
                head = head[len(self.BOT) :].lstrip()
            elif self.BOT.startswith(head):  # whitespace or part of the tag so far
                return False
            if not head:
                return False
            if head[0] != "{":  # not a call: the whole output is content
                self._state = "text"
                return True
            self._begin_call(self._buf[: len(self._buf) - len(head)])
            self._buf = head
        elif not head:  # (after, separator): whitespace so far
            return False
        elif head[0] == ";" and self._state == "after":
            self._buf, self._state = head[1:], "separator"
        elif head[0] == "{":
            self._begin_call("")
            self._buf = head
        else:
            self._buf, self._state = head, "text"
        return True

    def _call_ended(self) -> None:
        self._state = "after"

    def _finish_text(self) -> None:
        if self._state == "start":
            self._content(self._buf)
