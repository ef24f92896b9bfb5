"""``--tool-call-parser xlam``: Salesforce xLAM-2's tool calls (Llama 3.1 and Qwen2.5 models),
where vLLM's xLAMToolParser looks for them: a JSON array of calls

    [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]

that opens the output (after whitespace) or follows a ``</think>`` (a ``[`` not followed by a
``{`` is text, so a fence after ``[1] ...`` still holds calls), or, anywhere in the text,
one in a ```` ```json ```` (or bare ```` ``` ````) fence, after ``[TOOL_CALLS]`` or in a
``<tool_call>...</tool_call>`` block. The text around the calls is content, ``</think>`` and
what comes before it too (as vLLM's); whitespace next to the calls is dropped, as Hermes's. A
fence that does not open an array is a code block: content, to its closing fence. Each call's id
is vLLM's ``call_<index>_<uuid hex>``.
"""
from __future__ import annotations

import re
import uuid
from typing import Any

from vllmini.engine.sampling_params import SamplingParams
from vllmini.entrypoints.openai.tool_parsers.abstract_tool_parser import partial_tag
from vllmini.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

TOOL_CALLS, THINK_END, FENCE = "[TOOL_CALLS]", "</think>", "```"
WRAPPERS = {TOOL_CALLS: "", "<tool_call>": "</tool_call>", FENCE: FENCE}  # opening tag: its closing one
MARKERS = (*WRAPPERS, THINK_END)
_FENCE_OPEN = re.compile(r"```(?:json)?[ \t\r\n]*")
_FENCE_PENDING = re.compile(r"(?:json[ \t\r\n]*|jso|js|j|[ \t\r\n]*)")  # (after ```: may still open an array)


class XLAMToolParser(Hermes2ProToolParser):
    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        # start (a bare array may open the text: the output's start, after </think>), text, code
        # (in a fenced block that holds no calls)
        self._state = "start"
        self._end = ""  # the closing tag of the calls being read
        self._ids = 0  # the calls given an id

    def adjust_request(self, params: SamplingParams) -> SamplingParams:
        return params  # (as vLLM's: none of its tags is a special token of xLAM's tokenizers)

    def tool_call_id(self) -> str:
        index, self._ids = self._ids, self._ids + 1
        return f"call_{index}_{uuid.uuid4().hex}"

    def _step(self) -> bool:
        if self._closing:
            if not self._close(self._end):
                return False
            self._state = "text"
            return True
        if self._state == "start":
            head = self._buf.lstrip()
            if TOOL_CALLS.startswith(head) and head != TOOL_CALLS:  # whitespace or maybe the tag so far
                return False
            opens_object = head[1:].lstrip()[:1]  # (an array of calls: "[" then "{")
            if head[0] == "[" and not head.startswith(TOOL_CALLS) and not opens_object:
                return False  # ("[" and whitespace so far)
            self._state = "text"
            if head[0] == "[" and not head.startswith(TOOL_CALLS) and opens_object == "{":
                self._calls_begin(len(self._buf) - len(head), 0, "")
            return True
        if self._state == "code":
            i = self._buf.find(FENCE)
            if i < 0:
                keep = len(self._buf) - partial_tag(self._buf, FENCE)
                self._text(self._buf[:keep])
                self._buf = self._buf[keep:]
                return False
            self._text(self._buf[: i + len(FENCE)])
            self._buf, self._state = self._buf[i + len(FENCE) :], "text"
            return True
        hits = [(i, tag) for tag in MARKERS if (i := self._buf.find(tag)) >= 0]
        if not hits:
            keep = len(self._buf) - max(partial_tag(self._buf, tag) for tag in MARKERS)
            self._text(self._buf[:keep])
            self._buf = self._buf[keep:]
            return False
        i, tag = min(hits)
        if tag == THINK_END:
            self._text(self._buf[: i + len(tag)])
            self._buf, self._state = self._buf[i + len(tag) :], "start"
            return True
        self._text(self._buf[:i])
        self._buf = self._buf[i:]
        if tag != FENCE:
            self._calls_begin(0, len(tag), WRAPPERS[tag])
            return True
        opening = _FENCE_OPEN.match(self._buf).end()
        if _FENCE_PENDING.fullmatch(self._buf, len(FENCE)):
            return False  # (the language or the whitespace may go on)
        if self._buf[opening] == "[":
            self._calls_begin(0, opening, FENCE)
        else:
            self._text(FENCE)
            self._buf, self._state = self._buf[len(FENCE) :], "code"
        return True

    def _calls_begin(self, ws: int, tag: int, end: str) -> None:
        """An array of calls begins after ``ws`` characters of whitespace and a ``tag`` characters
        long (in ``_buf``); ``end``: the tag that closes the calls."""
        self._begin_call(self._ws + self._buf[: ws + tag], array=True)
        self._buf, self._ws, self._end = self._buf[ws + tag :], "", end
