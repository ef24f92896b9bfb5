"""``--tool-call-parser granite``: IBM Granite 3.0 / 3.1's tool calls, as vLLM's parser reads them:

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]

Granite 3.0 writes the special token ``<|tool_call|>``, 3.1 the string ``<tool_call>``; either
(or both, or neither) opens the output, then a JSON array of calls. An output that does not
begin so (after whitespace) is plain content, as vLLM decides; text after the array is content
(vLLM's reading drops it).
"""
from __future__ import annotations

from vllmini.engine.sampling_params import SamplingParams
from vllmini.entrypoints.openai.tool_parsers.abstract_tool_parser import keep_special_tokens
from vllmini.entrypoints.openai.tool_parsers.llama_tool_parser import Llama3JsonToolParser


class GraniteToolParser(Llama3JsonToolParser):
    TAGS = ("<|tool_call|>", "<tool_call>")  # (3.0's token first: vLLM strips them in this order)

    def adjust_request(self, params: SamplingParams) -> SamplingParams:
        # <|tool_call|> is a special token of Granite 3.0's tokenizer: kept in the text, or no call could be read
        return keep_special_tokens(params)

    def _step(self) -> bool:
        if self._state == "text":
            self._content(self._buf)
            self._buf = ""
            return False
        if self._state == "after":  # the array was read: whitespace after it is dropped, the rest is content
            rest = self._buf.lstrip()
            if not rest:
                return False
            self._buf, self._state = rest, "text"
            return True
        head = self._buf.lstrip()
        for tag in self.TAGS:
            if head.startswith(tag):
                head = head[len(tag) :].lstrip()
        if not head or any(tag.startswith(head) for tag in self.TAGS):  # whitespace or part of a tag so far
            return False
        if head[0] != "[":  # not calls: the whole output is content
            self._state = "text"
            return True
        self._begin_call(self._buf[: len(self._buf) - len(head)], array=True)
        self._buf = head
        return True
