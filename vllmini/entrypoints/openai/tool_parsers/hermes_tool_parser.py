"""``--tool-call-parser hermes``: Hermes 2 Pro's format, also Qwen2.5's and Qwen3's templates':

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each ``<tool_call>`` block holds one call's JSON; the closing tag may be left out (a stop string
or the end of the output). The text outside the blocks is the content; whitespace next to a
block is not (it only separates the blocks). The tags are never written as content, unless a
block's JSON cannot be read (then, as vLLM, the output from there is content).
"""
from __future__ import annotations

from typing import Any

from vllmini.engine.sampling_params import SamplingParams
from vllmini.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser, keep_special_tokens, partial_tag


class Hermes2ProToolParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"  # (END "": the calls end with their JSON)
    ARRAY = False  # each block holds one call's JSON object (True: a JSON array of calls)
    TEXT_AFTER_CALLS = True  # False: the text after the first call is not content (ERNIE's, GLM's, as vLLM reads them)

    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._closing = False  # after a block's JSON: its closing tag may come
        self._ws = ""  # whitespace after the content written: held, as it is dropped before a block
        self._lead = False  # text right after a block: its leading whitespace is dropped

    def adjust_request(self, params: SamplingParams) -> SamplingParams:
        # in Hermes 2 Pro the tags are special tokens: left out of the text, no call could be read (as vLLM)
        return keep_special_tokens(params)

    def _step(self) -> bool:
        if self._closing:
            return self._close(self.END)
        i = self._buf.find(self.START)
        if i < 0:
            keep = len(self._buf) - partial_tag(self._buf, self.START)
            self._text(self._buf[:keep])
            self._buf = self._buf[keep:]
            return False
        self._text(self._buf[:i])
        self._begin_call(self._ws + self.START, array=self.ARRAY)
        self._buf, self._ws = self._buf[i + len(self.START) :], ""
        return True

    def _close(self, end: str) -> bool:
        """After a block's JSON: its closing tag ``end`` (if any) is read; False: wait for more text."""
        rest = self._buf.lstrip()
        if end.startswith(rest):  # whitespace or part of the closing tag so far
            return False
        self._buf = rest.removeprefix(end)  # (a block without its closing tag ends at its JSON)
        self._closing, self._lead = False, True
        return True

    def _call_ended(self) -> None:
        self._closing = True

    def _text(self, text: str) -> None:
        if self._started and not self.TEXT_AFTER_CALLS:
            return
        if self._lead:
            text = text.lstrip()
            if not text:
                return
            self._lead = False
        body = text.rstrip()
        if body:
            self._content(self._ws + body)
            self._ws = text[len(body) :]
        else:
            self._ws += text

    def _finish_text(self) -> None:
        if not self._closing:
            self._text(self._buf)
            self._content(self._ws)
        self._ws = ""
