"""``--tool-call-parser openai``: gpt-oss's tool calls, harmony messages addressed to a function
(harmony_utils.py reads them), as vLLM's ``OpenAIToolParser``:

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(the recipient may also follow the role: ``<|start|>assistant to=functions.get_weather<|channel|>
commentary json<|message|>``). Each is one call: the name after ``functions.``, the body its
arguments, the JSON text as written (vLLM's whole reading re-dumps it, its streamed one sends it
as written). A call cut short (max_tokens) keeps the arguments written so far, as a stream has
sent them. With ``--reasoning-parser openai_gptoss`` the content this parser reads is the final
messages' text with the calls left in; without it, the whole output: everything but the calls is
then content as written (tags too), as the other tool parsers leave a ``<think>`` section.
"""
from __future__ import annotations

from typing import Any

from vllmini.engine.sampling_params import SamplingParams
from vllmini.entrypoints.openai.tool_parsers.harmony_utils import Event, HarmonyReader, Header
from vllmini.entrypoints.openai.tool_parsers.abstract_tool_parser import Piece, ToolParser, keep_special_tokens


class OpenAIToolParser(ToolParser):
    """Reads the harmony events of the text: a call's header writes the call, its body the
    arguments, its end tag nothing; every other event's text is content as it was."""

    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._reader = HarmonyReader()
        self._call: int | None = None  # the index of the call whose arguments are being read

    def adjust_request(self, params: SamplingParams) -> SamplingParams:
        # the tags are special tokens of gpt-oss's tokenizer: skipped, no call could be read
        return keep_special_tokens(params)

    def extract_tool_calls_streaming(self, delta_text: str) -> list[Piece]:
        self._read_events(self._reader.feed(delta_text))
        return self._take()

    def finish_streaming(self) -> list[Piece]:
        self._read_events(self._reader.finish())
        return self._take()

    def _read_events(self, events: list[Event]) -> None:
        for kind, value in events:
            if isinstance(value, Header):
                if value.function is not None:
                    self._call = self._write_call(value.function)
                else:
                    self._content(value.raw)
            elif self._call is None:
                self._content(value)
            elif kind == "body":
                self._out.append(("args", self._call, value))
            elif kind == "end":
                self._call = None
