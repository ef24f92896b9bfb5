"""One chat choice's output read as vLLM's server reads it: the reasoning first
(``--reasoning-parser``), then the tool calls in what is left (the content), whole or a delta
at a time. The streamed deltas are built from the same pieces as the whole message, so they add
up to it.
"""
from __future__ import annotations

from vllmini.entrypoints.openai.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall, ToolCall
from vllmini.entrypoints.openai.reasoning_parsers import ReasoningParser
from vllmini.entrypoints.openai.tool_parsers.abstract_tool_parser import Piece, ToolParser


class ChatOutputParser:
    """``reasoning`` and ``tools`` are fresh parsers (either may be None); with
    ``parallel_tool_calls=False`` only the first call is kept, with ``include_reasoning=False``
    the reasoning is read but left out (vLLM's request fields)."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, parallel_tool_calls: bool = True,
                 include_reasoning: bool = True) -> None:  # fmt: skip
        self.reasoning, self.tools, self.parallel_tool_calls = reasoning, tools, parallel_tool_calls
        self.include_reasoning = include_reasoning
        self.tools_called = False
        if reasoning is not None:
            reasoning.hand_calls_to(tools)

    def parse(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning, content, tool calls) of a whole output."""
        reasoning, content = (None, text) if self.reasoning is None else self.reasoning.extract_reasoning(text)
        reasoning = reasoning if self.include_reasoning else None
        if self.tools is None:
            return reasoning, content, []
        info = self.tools.extract_tool_calls(content or "")
        calls = info.tool_calls if self.parallel_tool_calls else info.tool_calls[:1]
        self.tools_called = bool(calls)
        return reasoning, info.content if info.tools_called else content, calls

    def delta(self, text: str, final: bool = False) -> DeltaMessage | None:
        """The delta of the output's next text (None: nothing to send yet); ``final``: the output
        is complete, so what the parsers held back comes too."""
        if self.reasoning is None:
            pieces: list[Piece] = [("content", text)] if text else []
        else:
            pieces = self.reasoning.extract_reasoning_streaming(text)
            if final:
                pieces += self.reasoning.finish_streaming()
        if self.tools is not None:
            read: list[Piece] = []
            for piece in pieces:
                read += self.tools.extract_tool_calls_streaming(piece[1]) if piece[0] == "content" else [piece]
            pieces = read + (self.tools.finish_streaming() if final else [])
        return self._message(pieces)

    def _message(self, pieces: list[Piece]) -> DeltaMessage | None:
        texts: dict[str, str] = {}
        calls: dict[int, DeltaToolCall] = {}
        for piece in pieces:
            if len(piece) == 2:
                if piece[0] != "reasoning" or self.include_reasoning:
                    texts[piece[0]] = texts.get(piece[0], "") + piece[1]
                continue
            kind, index, text = piece
            if index > 0 and not self.parallel_tool_calls:
                continue
            if kind == "call":
                self.tools_called = True
                assert self.tools is not None
                calls[index] = DeltaToolCall(index=index, id=self.tools.tool_call_id(), type="function",
                                             function=DeltaFunctionCall(name=text, arguments=""))  # fmt: skip
            elif index in calls:
                calls[index].function.arguments += text
            else:
                calls[index] = DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=text))
        if not texts and not calls:
            return None
        reasoning = texts.get("reasoning")
        return DeltaMessage(content=texts.get("content"), reasoning=reasoning, reasoning_content=reasoning,
                            tool_calls=[calls[i] for i in sorted(calls)])  # fmt: skip
