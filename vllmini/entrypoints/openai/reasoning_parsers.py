"""Reasoning parsers by name (vLLM's ``--reasoning-parser``): the text between ``<think>`` and
``</think>`` is the message's reasoning, the rest its content.

- ``deepseek_r1``: the output starts in reasoning (DeepSeek-R1's template may have written the
  ``<think>`` already): the text before ``</think>`` is reasoning, all of it when there is none
  (an output cut short while thinking).
- ``qwen3``: the output is content unless it opens ``<think>`` itself, or the rendered prompt
  left a ``<think>`` open (newer Qwen templates write it); with ``enable_thinking=False`` (a
  ``chat_template_kwargs``) Qwen3's template closes an empty think block in the prompt, so the
  whole output is content.
- ``olmo3`` reads as ``deepseek_r1``, ``exaone4`` and ``glm45`` as ``qwen3`` (see their classes); ``granite``:
  Granite 3.2's plain-text markers, "Here is my thought process:" ... "Here is my response:".
- ``ernie45`` (ERNIE 4.5 Thinking) reads as ``deepseek_r1``; its content may be wrapped in
  ``<response>`` ... ``</response>`` (see its class).
- ``mistral`` (Magistral): ``[THINK]`` and ``[/THINK]`` instead, read as qwen3's, but a
  ``[THINK]`` after some content still opens the (one) reasoning section, and the tags, special
  tokens there, are kept in the text (``skip_special_tokens=False``).
- ``openai_gptoss`` (gpt-oss): harmony messages, not think tags: the analysis channel is the
  reasoning, the final channel the content (harmony_utils.py reads them; see its class).

A request with structured outputs is constrained from its first token (here the grammar does not
wait for the reasoning to end, as vLLM's does), so its output starts in content unless it opens
``<think>`` itself. Streamed and whole, the same reader runs (a ``</think>`` split across
deltas is held back), so the two agree.
"""
from __future__ import annotations

from typing import Any

from vllmini.engine.sampling_params import SamplingParams
from vllmini.entrypoints.openai.tool_parsers import harmony_utils as harmony
from vllmini.entrypoints.openai.tool_parsers.openai_tool_parser import OpenAIToolParser
from vllmini.entrypoints.openai.tool_parsers.abstract_tool_parser import Piece, ToolParser, keep_special_tokens, partial_tag


class ReasoningParser:
    START, END = "<think>", "</think>"
    UNOPENED = "content"  # the state of an output that does not start in reasoning (Mistral's: "before")

    def __init__(self, tokenizer: Any = None, in_reasoning: bool = False) -> None:
        self.tokenizer = tokenizer
        self.in_reasoning = in_reasoning  # where the output starts, when it does not open <think>
        self._state = "start"  # start (a <think> may open the output), reasoning, content
        self._buf = ""
        self._out: list[Piece] = []

    @classmethod
    def adjust_request(cls, params: SamplingParams) -> SamplingParams:
        """The sampling parameters this parser needs (e.g. its tags, special tokens, left in the text)."""
        return params

    @classmethod
    def starts_in_reasoning(cls, prompt: str) -> bool:
        """Whether the output of this prompt starts inside a think block (its own <think> aside)."""
        return prompt.rfind(cls.START) > prompt.rfind(cls.END)

    def extract_reasoning(self, model_output: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output, each None when empty."""
        parser = self.fresh()
        pieces = parser.extract_reasoning_streaming(model_output) + parser.finish_streaming()
        reasoning = "".join(p[1] for p in pieces if p[0] == "reasoning")
        content = "".join(p[1] for p in pieces if p[0] == "content")
        return reasoning or None, content or None

    def fresh(self) -> ReasoningParser:
        """A parser of this kind, set up as this one, with nothing read yet."""
        return type(self)(self.tokenizer, self.in_reasoning)

    def hand_calls_to(self, tools: ToolParser | None) -> None:
        """The tool parser that reads the content after this one (None: none). A format whose
        tool calls this parser reads too (gpt-oss's harmony) passes them on only to one that
        reads them."""

    def extract_reasoning_streaming(self, delta_text: str) -> list[Piece]:
        """``("reasoning", text)`` and ``("content", text)`` pieces of the output's next text."""
        self._buf += delta_text
        while self._buf and self._step():
            pass
        out, self._out = self._out, []
        return out

    def _step(self) -> bool:
        """Read some of ``_buf`` in the current state; False: wait for more text."""
        if self._state == "start":
            head = self._buf.lstrip()
            if head.startswith(self.START):
                self._buf, self._state = head[len(self.START) :], "reasoning"
                return True
            if self.START.startswith(head):  # whitespace or part of the tag so far
                return False
            self._state = "reasoning" if self.in_reasoning else self.UNOPENED
        elif self._state == "reasoning":
            if self._read_until("reasoning", self.END) is None:
                return False
            self._state = "content"
        else:
            self._emit("content", self._buf)
            self._buf = ""
        return True

    def _read_until(self, kind: str, *tags: str) -> str | None:
        """Write ``_buf`` as ``kind`` up to the first of ``tags`` and return that tag (``_buf`` is
        then the text after it); None: none yet (an end that may begin one is held back)."""
        found = [(i, tag) for tag in tags if (i := self._buf.find(tag)) >= 0]
        if not found:
            keep = len(self._buf) - max(partial_tag(self._buf, tag) for tag in tags)
            self._emit(kind, self._buf[:keep])
            self._buf = self._buf[keep:]
            return None
        i, tag = min(found)
        self._emit(kind, self._buf[:i])
        self._buf = self._buf[i + len(tag) :]
        return tag

    def finish_streaming(self) -> list[Piece]:
        """What was held back, once the output is complete."""
        if self._state == "start":
            self._state = "reasoning" if self.in_reasoning else self.UNOPENED
        self._emit("reasoning" if self._state == "reasoning" else "content", self._buf)
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


class Olmo3ReasoningParser(DeepSeekR1ReasoningParser):
    """OLMo 3 Think: read as deepseek_r1 (the output starts in reasoning, the ``<think>`` optional:
    its template may write it; the tags are plain text). vLLM's reads an output with no
    ``</think>`` as all content whole but as reasoning streamed; this one, streamed or whole, as reasoning."""


class Exaone4ReasoningParser(Qwen3ReasoningParser):
    """EXAONE 4.0: read as qwen3: reasoning when the prompt leaves ``<think>`` open (its template
    with ``enable_thinking=True``) or the output opens one; else content (vLLM's: all content
    when thinking is off, even an output that writes ``<think>``)."""


class Glm45ReasoningParser(Qwen3ReasoningParser):
    """GLM-4.5 / 4.6: read as qwen3: the model opens ``<think>`` itself; with ``enable_thinking=False``
    its template closes an empty ``<think></think>`` in the prompt, so the output is content. (vLLM's
    whole reading makes an output without ``</think>`` all content, its streamed one reasoning after
    ``<think>``; this one, whole and streamed, reasoning.)"""


class GraniteReasoningParser(ReasoningParser):
    """IBM Granite 3.2/3.3 (``thinking=True`` in its chat template): plain-text markers, each in
    either wording, as vLLM's: an output that opens with "Here is my thought process:" reasons
    until "Here is my response:", then is content; any other output is all content. (vLLM's
    whole-output reading finds the markers anywhere; its streamed one, as this one, only at the start.)"""

    STARTS = ("Here is my thought process:", "Here's my thought process:")
    ENDS = ("Here is my response:", "Here's my response:")

    @classmethod
    def starts_in_reasoning(cls, prompt: str) -> bool:
        return False

    def _step(self) -> bool:
        if self._state == "start":
            head = self._buf.lstrip()
            opening = next((tag for tag in self.STARTS if head.startswith(tag)), None)
            if opening is not None:
                self._buf, self._state = head[len(opening) :], "reasoning"
                return True
            if any(tag.startswith(head) for tag in self.STARTS):  # whitespace or part of a marker so far
                return False
            self._state = "content"
            return True
        if self._state != "reasoning":
            return super()._step()
        if self._read_until("reasoning", *self.ENDS) is None:
            return False
        self._state = "content"
        return True


class Ernie45ReasoningParser(DeepSeekR1ReasoningParser):
    """ERNIE 4.5 Thinking: ``reasoning\n</think>\n\n<response>\ncontent\n</response>\n``, or
    plain content after ``</think>``. Read as deepseek_r1 (the output starts in reasoning), then
    the newlines after ``</think>`` are dropped and a ``<response>`` opening the content leaves
    only the text up to ``</response>`` as content (whitespace after it dropped, anything else
    after it content). The tags are plain text in ERNIE's output, as vLLM's parser reads them.

    vLLM's whole and streamed readings differ at the edges; this one, whole and streamed alike,
    takes its streamed reading's newlines after ``</think>`` (dropped; the whole reading keeps
    them when there is no ``<response>``), its ``<response>`` left unclosed (dropped; the whole
    reading keeps the tag) and its text after ``</response>`` (content; the whole reading drops
    it). A ``<response>`` after other content is text, where vLLM's whole reading drops what
    comes before it."""

    RESPONSE, RESPONSE_END = "<response>", "</response>"

    def _step(self) -> bool:
        if self._state == "reasoning":
            stepped = super()._step()
            if self._state == "content":  # (</think> was read)
                self._state = "opening"
            return stepped
        if self._state == "opening":  # newlines, then <response> or the content
            head = self._buf.lstrip("\n")
            if head.startswith(self.RESPONSE):
                self._buf, self._state = head[len(self.RESPONSE) :], "response"
                return True
            if self.RESPONSE.startswith(head):  # newlines or part of the tag so far
                return False
            self._buf, self._state = head, "content"
            return True
        if self._state == "response":
            if self._read_until("content", self.RESPONSE_END) is None:
                return False
            self._state = "closed"
            return True
        if self._state == "closed":  # whitespace after </response> is dropped
            head = self._buf.lstrip()
            self._buf = head
            if not head:
                return False
            self._state = "content"
            return True
        return super()._step()

    def finish_streaming(self) -> list[Piece]:
        if self._state == "opening":
            self._buf = self._buf.lstrip("\n")
        return super().finish_streaming()


class MistralReasoningParser(ReasoningParser):
    """Magistral's ``[THINK]...[/THINK]`` (special tokens: kept in the text). As vLLM's, the output
    is content unless it writes ``[THINK]`` (anywhere: the text before it is content), one
    section only (after ``[/THINK]`` all is content), a ``[/THINK]`` before any ``[THINK]`` is
    dropped, and a ``[THINK]`` without its end makes the rest reasoning."""

    START, END = "[THINK]", "[/THINK]"
    UNOPENED = "before"  # content in which a [THINK] may still open the section

    @classmethod
    def adjust_request(cls, params: SamplingParams) -> SamplingParams:
        # the tags are special tokens of Magistral's tokenizer: skipped, no reasoning could be read
        return keep_special_tokens(params)

    def _step(self) -> bool:
        if self._state != "before":
            return super()._step()
        tag = self._read_until("content", self.START, self.END)
        if tag is None:
            return False
        if tag == self.START:  # (an end without a start is dropped)
            self._state = "reasoning"
        return True


class GptOssReasoningParser(ReasoningParser):
    """gpt-oss's harmony messages (harmony_utils.py), as vLLM's ``openai_gptoss``: analysis
    messages are the reasoning, final messages and preambles (commentary to no one) the content,
    several of a kind joined by a newline (vLLM's whole reading; its streamed one joins them
    without). A message addressed to a function is a tool call: passed on as harmony text in the
    content to the ``openai`` tool parser, else dropped (as vLLM's); other messages are dropped.
    Text outside any message (an output with no harmony tags) is content. The tags are special
    tokens, kept in the text. ``START``/``END``, the thinking budget's and a grammar's strings:
    an analysis message opens the reasoning, the final message's header (after ``<|end|>``, so a
    forced end is well-formed harmony) closes it, as vLLM's ``is_reasoning_end``."""

    START = harmony.CHANNEL + "analysis" + harmony.MESSAGE
    END = harmony.END + harmony.START + "assistant" + harmony.CHANNEL + "final" + harmony.MESSAGE

    def __init__(self, tokenizer: Any = None, in_reasoning: bool = False) -> None:
        super().__init__(tokenizer, in_reasoning)
        self._reader = harmony.HarmonyReader(harmony.ANALYSIS if in_reasoning else None)
        self._kind: str | None = "reasoning" if in_reasoning else None  # what the body being read is
        self._begun = False  # the body being read has text
        self._said: set[str] = set()  # the kinds with text so far (a new message of one is joined by "\n")
        self._passing = False  # the body being read is a call, passed on
        self._pass_calls = False

    @classmethod
    def adjust_request(cls, params: SamplingParams) -> SamplingParams:
        # the tags are special tokens of gpt-oss's tokenizer: skipped, no message could be read
        return keep_special_tokens(params)

    @classmethod
    def starts_in_reasoning(cls, prompt: str) -> bool:
        """Only a prompt that ends opening an analysis message (the template's generation
        prompt, ``<|start|>assistant``, leaves the header to the model; earlier turns' analysis
        messages are closed)."""
        return prompt.endswith(cls.START)

    def fresh(self) -> GptOssReasoningParser:
        parser = type(self)(self.tokenizer, self.in_reasoning)
        parser._pass_calls = self._pass_calls
        return parser

    def hand_calls_to(self, tools: ToolParser | None) -> None:
        self._pass_calls = isinstance(tools, OpenAIToolParser)

    def extract_reasoning_streaming(self, delta_text: str) -> list[Piece]:
        return self._read(self._reader.feed(delta_text))

    def finish_streaming(self) -> list[Piece]:
        return self._read(self._reader.finish())

    def _read(self, events: list[harmony.Event]) -> list[Piece]:
        for kind, value in events:
            if kind == "text":
                self._said.add("content")
                self._emit("content", value)
            elif kind == "header":
                assert isinstance(value, harmony.Header)
                self._kind, self._begun = value.kind, False
                self._passing = value.kind == "call" and self._pass_calls
                if self._passing:
                    self._emit("content", value.written())
            elif kind == "body":
                assert isinstance(value, str)
                self._body(value)
            elif kind == "end":
                if self._passing:  # (the tool parser needs the end of the call)
                    self._emit("content", value or harmony.CALL)
                self._kind, self._passing = None, False
        out, self._out = self._out, []
        return out

    def _body(self, text: str) -> None:
        if self._passing:
            self._emit("content", text)
        elif self._kind in ("reasoning", "content"):
            if not self._begun:
                self._begun = True
                if self._kind in self._said:
                    self._emit(self._kind, "\n")
                self._said.add(self._kind)
            self._emit(self._kind, text)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "ernie45": Ernie45ReasoningParser,
    "exaone4": Exaone4ReasoningParser,
    "glm45": Glm45ReasoningParser,
    "granite": GraniteReasoningParser,
    "mistral": MistralReasoningParser,
    "olmo3": Olmo3ReasoningParser,
    "openai_gptoss": GptOssReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class of ``--reasoning-parser NAME``; ValueError naming the choices."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser: unknown parser {name!r} (choose from {', '.join(REASONING_PARSERS)})")
    return REASONING_PARSERS[name]
