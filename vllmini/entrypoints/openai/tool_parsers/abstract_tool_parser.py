"""What every tool-call parser shares: reading tool calls out of a model's output, streamed (a
delta at a time) or whole.

A parser is a state machine fed the output's text; it writes *pieces*: ``("content", text)``
for text outside the calls, ``("call", index, name)`` when a call's name is known and
``("args", index, text)`` for its arguments (the JSON text of ``json.dumps(arguments,
ensure_ascii=False)``, as vLLM's parsers return them, written as it is read: json_stream.py).
The whole output is read by the same machine in one delta, so the streamed and the whole
answers agree however the text was split; where vLLM's ``extract_tool_calls`` returns the whole
output as content (a call it cannot read), so does this (``error`` is set), and a stream whose
broken call had written nothing yet falls back to content from that call's start.

The JSON of calls is read here: one call's object, or an array of them (Mistral's, a "required"
tool choice's). Formats whose argument values are read whole (pythonic's Python literals,
Qwen3-Coder's XML parameters) write a call's arguments a member at a time (``Arguments``).

The method names are vLLM's; the streaming one takes only the new text (the parser keeps the rest).
"""
from __future__ import annotations

import ast
import json
from typing import Any, Callable, Union

from vllmini.engine.sampling_params import SamplingParams
from vllmini.entrypoints.openai.protocol import ExtractedToolCallInformation, FunctionCall, ToolCall, make_tool_call_id
from vllmini.entrypoints.openai.tool_parsers.json_stream import JsonError, JsonStream, Path, json_text

ARGUMENT_KEYS = ("arguments", "parameters")  # Llama 3.x writes "parameters"; the first one given is used

Piece = Union[tuple[str, str], tuple[str, int, str]]


class _Call:
    """One call being read: its name's JSON text and its arguments' so far."""

    def __init__(self) -> None:
        self.name_json = ""
        self.name: str | None = None
        self.args_key: str | None = None
        self.args = ""
        self.sent = 0  # characters of args written as pieces
        self.index: int | None = None  # its place in tool_calls, once its name is known

    def take(self, path: Path, piece: str) -> None:
        """A piece of the call object's canonical text (its own braces and keys are left out)."""
        if not path:
            return
        if path[0] == "name":
            self.name_json += piece
        elif path[0] in ARGUMENT_KEYS and self.args_key in (None, path[0]):
            self.args_key = path[0]
            self.args += piece


class ToolParser:
    """The base of the tool parsers: the text waits in ``_buf``; a call's JSON (after
    ``_begin_call``) is read here, the rest by the subclass's ``_step`` (which writes content,
    begins calls, and returns False to wait for more text), ``_call_ended`` and ``_finish_text``.
    ``tools``: the request's tools (a parser that reads arguments as text types them by their schema)."""

    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools
        self.error: str | None = None  # why a call could not be read (the whole output is then content)
        self._out: list[Piece] = []
        self._buf = ""  # text not read yet (e.g. what may be the start of a tag)
        self._started = 0  # calls whose name was written
        self._json: JsonStream | None = None
        self._array = False  # the JSON being read is an array of calls (else one call's object)
        self._calls: dict[int, _Call] = {}  # the calls of that JSON, by their place in it
        self._call_written = False  # a call of the text being read was written (its name)
        self._raw = ""  # the text of the call being read (and of the whitespace before it), for a fallback
        self._fallen_back = False

    def adjust_request(self, params: SamplingParams) -> SamplingParams:
        """The sampling parameters this parser needs (e.g. special tokens left in the text)."""
        return params

    # -- the API
    def extract_tool_calls(self, model_output: str) -> ExtractedToolCallInformation:
        """The calls in a whole output (read by a fresh parser of this kind) and the text outside them."""
        parser = self.fresh()
        pieces = parser.extract_tool_calls_streaming(model_output) + parser.finish_streaming()
        calls = collect_tool_calls(pieces, self.tool_call_id)
        if parser.error is not None or not calls:
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        content = "".join(p[1] for p in pieces if p[0] == "content")
        return ExtractedToolCallInformation(tools_called=True, tool_calls=calls, content=content or None)

    def fresh(self) -> ToolParser:
        """A parser of this kind with nothing read yet."""
        return type(self)(self.tokenizer, self.tools)

    def tool_call_id(self) -> str:
        """A new call's id (vLLM's, or the format a model family needs)."""
        return make_tool_call_id()

    def extract_tool_calls_streaming(self, delta_text: str) -> list[Piece]:
        """The pieces of the output's next text."""
        if self._fallen_back:
            self._content(delta_text)
        else:
            self._read(delta_text)
        return self._take()

    def finish_streaming(self) -> list[Piece]:
        """The pieces held back for more text (a possible tag...), once the output is complete."""
        if not self._fallen_back:
            self._finish()
        return self._take()

    def _read(self, text: str) -> None:
        self._buf += text
        while self._buf and not self._fallen_back:
            if self._in_call:
                self._buf = self._buf[self._read_call(self._buf) :]
                if self._in_call:
                    break
                self._call_ended()
            elif not self._step():
                break
        if self._fallen_back:
            self._buf = ""

    def _finish(self) -> None:
        if self._in_call:
            self._end_incomplete_call()
        else:
            self._finish_text()
        self._buf = ""

    # -- for the subclasses
    def _step(self) -> bool:
        """Read some of ``_buf`` outside a call's JSON; False: wait for more text."""
        raise NotImplementedError

    def _call_ended(self) -> None:
        """A call's JSON was read."""

    def _finish_text(self) -> None:
        """The output ended outside a call's JSON: what ``_buf`` still holds."""

    def _take(self) -> list[Piece]:
        out, self._out = self._out, []
        return out

    def _content(self, text: str) -> None:
        if text:
            self._out.append(("content", text))

    def _begin_call(self, raw: str, array: bool = False) -> None:
        """A call's JSON object starts (``array``: a JSON array of call objects); ``raw``: its text
        so far (a tag, the whitespace before it), which becomes content again if the call cannot be read."""
        self._json, self._array, self._raw, self._call_written = JsonStream(), array, raw, False
        self._calls = {} if array else {0: _Call()}

    @property
    def _in_call(self) -> bool:
        return self._json is not None and not self._json.done

    def _read_call(self, text: str) -> int:
        """Read the call's JSON in ``text``: the characters read (all of them after a fallback)."""
        assert self._json is not None
        try:
            n, pieces = self._json.feed(text)
            for path, piece in pieces:
                if not self._array:
                    self._calls[0].take(path, piece)
                elif path:  # (the array's own brackets and commas are not a call's)
                    self._calls.setdefault(path[0], _Call()).take(path[1:], piece)
                elif piece == "{":
                    raise JsonError("expected a JSON array of tool calls, got an object")
            for i in sorted(self._calls):
                self._advance(self._calls[i])
            if self._json.done:
                if not self._calls:
                    raise JsonError("an empty array of tool calls")
                for i in sorted(self._calls):
                    self._end_call(self._calls[i])
        except JsonError as exc:
            self._fall_back(str(exc), text)
            return len(text)
        self._raw += text[:n]
        return n

    def _end_incomplete_call(self) -> None:
        """The output ended inside a call's JSON."""
        self._fall_back("the output ends inside a tool call", "")

    def _advance(self, call: _Call) -> None:
        """Write the call's name once it is known, then its arguments as they come."""
        if call.index is None and call.name_json:
            try:
                name = json.loads(call.name_json)
            except ValueError:
                return  # not complete yet
            if not isinstance(name, str):
                raise JsonError(f"a tool call's name must be a string, got {call.name_json}")
            call.name, call.index = name, self._write_call(name)
        if call.index is not None and len(call.args) > call.sent:
            self._out.append(("args", call.index, call.args[call.sent :]))
            call.sent = len(call.args)

    def _write_call(self, name: str) -> int:
        """A call's name is known: it is written, with its index."""
        index, self._started, self._call_written = self._started, self._started + 1, True
        self._out.append(("call", index, name))
        return index

    def _end_call(self, call: _Call) -> None:
        if call.name_json == "":
            raise JsonError("a tool call without a name")
        if call.args_key is None:  # (a function without parameters; vLLM would give up on the call)
            call.args = "{}"
        self._advance(call)

    def _fall_back(self, error: str, rest: str, started: bool | None = None) -> None:
        """A call that cannot be read: the rest of the output is content; when nothing of the
        call was written yet (``started``), from its start."""
        self.error = error
        self._fallen_back = True
        self._json = None
        if started is None:
            started = self._call_written
        self._content(rest if started else self._raw + rest)


def collect_tool_calls(pieces: list[Piece], make_id: Callable[[], str] = make_tool_call_id) -> list[ToolCall]:
    """The whole calls that pieces describe."""
    calls: dict[int, ToolCall] = {}
    for piece in pieces:
        if piece[0] == "call":
            calls[piece[1]] = ToolCall(id=make_id(), function=FunctionCall(name=piece[2], arguments=""))
        elif piece[0] == "args":
            calls[piece[1]].function.arguments += piece[2]
    return [calls[i] for i in sorted(calls)]


def keep_special_tokens(params: SamplingParams) -> SamplingParams:
    """``params`` with ``skip_special_tokens`` off: for a parser whose tags are special tokens of the
    model's tokenizer (skipped, the parser could not read them)."""
    return params.clone(skip_special_tokens=False) if params.skip_special_tokens else params


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (held back: the tag may be
    completed by the next delta)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class Arguments:
    """A call's arguments written a member at a time, for the formats whose values are read
    whole (Python literals, XML parameters): the pieces add up to ``json.dumps(arguments,
    ensure_ascii=False)``. A name given twice is refused (the pieces already written could not
    take it back)."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def member(self, name: str, value: Any) -> str:
        """The next member's text; ValueError for a repeated name or a value JSON cannot write."""
        if name in self.names:
            raise ValueError(f"the argument {name!r} is given twice")
        text = json_text(value)  # (first: a value that cannot be written leaves no name behind)
        self.names.add(name)
        return ("{" if len(self.names) == 1 else ", ") + json_text(name) + ": " + text

    def close(self) -> str:
        return "}" if self.names else "{}"


def python_literal(text: str) -> Any:
    """The value of a Python literal (strings, numbers, tuples, lists, dicts, sets, booleans,
    None), never running code: the text is parsed to a syntax tree whose node ast.literal_eval
    reads; ValueError when it is anything else (or too deep to parse)."""
    try:
        return ast.literal_eval(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError) as exc:
        raise ValueError(f"not a Python literal: {text[:40]!r} ({exc})") from None
