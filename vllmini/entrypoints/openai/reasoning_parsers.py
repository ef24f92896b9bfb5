"""Reasoning parsers by name (vLLM's ``--reasoning-parser``): the text between ``<think>`` and
``</think>`` is the message's reasoning, the rest its content.

- ``deepseek_r1``: the output starts in reasoning (DeepSeek-R1's template may have written the
  ``<think>`` already): the text before ``</think>`` is reasoning, all of it when there is none
  (an output cut short while thinking).
- ``qwen3``: the output is content unless it opens ``<think>`` itself, or the rendered prompt
  left a ``<think>`` open (newer Qwen templates write it); with ``enable_thinking=False`` (a
  ``chat_template_kwargs``) Qwen3's template closes an empty think block in the prompt, so the
  whole output is content.

A request with structured outputs is constrained from its first token (here the grammar does not
wait for the reasoning to end, as vLLM's does), so its output starts in content unless it opens
``<think>`` itself. Streamed and whole, the same reader runs (a ``</think>`` split across
deltas is held back), so the two agree.
"""
from __future__ import annotations

from typing import Any

from vllmini.entrypoints.openai.tool_parsers.abstract_tool_parser import Piece, partial_tag


class ReasoningParser:
    START, END = "<think>", "</think>"

    def __init__(self, tokenizer: Any = None, in_reasoning: bool = False) -> None:
        self.tokenizer = tokenizer
        self.in_reasoning = in_reasoning  # where the output starts, when it does not open <think>
        self._state = "start"  # start (a <think> may open the output), reasoning, content
        self._buf = ""
        self._out: list[Piece] = []

    @classmethod
    def starts_in_reasoning(cls, prompt: str) -> bool:
        """Whether the output of this prompt starts inside a think block (its own <think> aside)."""
        return prompt.rfind(cls.START) > prompt.rfind(cls.END)

    def extract_reasoning(self, model_output: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output, each None when empty."""
        parser = type(self)(self.tokenizer, self.in_reasoning)
        pieces = parser.extract_reasoning_streaming(model_output) + parser.finish_streaming()
        reasoning = "".join(p[1] for p in pieces if p[0] == "reasoning")
        content = "".join(p[1] for p in pieces if p[0] == "content")
        return reasoning or None, content or None

    def extract_reasoning_streaming(self, delta_text: str) -> list[Piece]:
        """``("reasoning", text)`` and ``("content", text)`` pieces of the output's next text."""
        self._buf += delta_text
        while self._buf:
            if self._state == "start":
                head = self._buf.lstrip()
                if head.startswith(self.START):
                    self._buf, self._state = head[len(self.START) :], "reasoning"
                    continue
                if self.START.startswith(head):  # whitespace or part of the tag so far
                    break
                self._state = "reasoning" if self.in_reasoning else "content"
            elif self._state == "reasoning":
                i = self._buf.find(self.END)
                if i < 0:
                    keep = len(self._buf) - partial_tag(self._buf, self.END)
                    self._emit("reasoning", self._buf[:keep])
                    self._buf = self._buf[keep:]
                    break
                self._emit("reasoning", self._buf[:i])
                self._buf, self._state = self._buf[i + len(self.END) :], "content"
            else:
                self._emit("content", self._buf)
                self._buf = ""
        out, self._out = self._out, []
        return out

    def finish_streaming(self) -> list[Piece]:
        """What was held back, once the output is complete."""
        if self._state == "start":
            self._state = "reasoning" if self.in_reasoning else "content"
        self._emit(self._state, self._buf)
        self._buf = ""
        out, self._out = self._out, []
        return out

    def _emit(self, kind: str, text: str) -> None:
        if text:
            self._out.append((kind, text))


class DeepSeekR1ReasoningParser(ReasoningParser):
    @classmethod
    def starts_in_reasoning(cls, prompt: str) -> bool:
        return True


class Qwen3ReasoningParser(ReasoningParser):
    pass


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class of ``--reasoning-parser NAME``; ValueError naming the choices."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser: unknown parser {name!r} (choose from {', '.join(REASONING_PARSERS)})")
    return REASONING_PARSERS[name]
