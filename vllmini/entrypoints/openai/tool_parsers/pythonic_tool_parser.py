"""``--tool-call-parser pythonic``: Llama 3.2's and Llama 4's calls written as a Python list of
function calls with keyword arguments, as vLLM's pythonic parser reads them:

    [get_weather(city='Paris', unit="celsius"), get_time(tz='CET')]

An output that opens (after whitespace) with ``[`` is read as such a list; any other output is
plain content (as vLLM). Each argument's value must be a Python literal (a string, number,
boolean, None, or a list / tuple / dict of them): its text, found by tracking brackets and
string quotes, is parsed with ``ast`` and read by ``ast.literal_eval`` (nothing is run), then
written as JSON. A call's name is written at its ``(``, its arguments a whole value at a time.
Text after the list is content (vLLM would drop it); a list that is not calls of literals (a
positional argument, ``x.f()``, ``a=b``, ``[]``...) makes the output content.
"""
from __future__ import annotations

import keyword
from typing import Any

from vllmini.entrypoints.openai.tool_parsers.abstract_tool_parser import Arguments, ToolParser, python_literal

_OPENERS = {"(": ")", "[": "]", "{": "}"}


class _Value:
    """Finds where an argument's value ends (a ``,`` or ``)`` outside brackets and strings)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.closers: list[str] = []  # the brackets opened in the value
        self.quote = ""  # the open string's quote (' " ''' or \"\"\"), "" outside strings
        self.opening = 0  # quote characters of a string's opening so far (a ''' needs three)
        self.escape = False
        self.run = 0  # closing quote characters in a row (in a triple-quoted string)

    def feed(self, ch: str) -> bool:
        """Read one character; True: it ends the value (and is not part of it)."""
        if self.opening:
            if ch == self.quote:  # a second quote: '' so far, a third: '''
                self.opening += 1
                if self.opening == 3:
                    self.quote, self.opening = ch * 3, 0
                self.text.append(ch)
                return False
            if self.opening == 2:  # '' : an empty string, closed; ch comes after it
                self.quote = ""
            self.opening = 0
        if self.quote:
            self._string(ch)
            self.text.append(ch)
            return False
        if ch in "'\"":
            self.quote, self.opening = ch, 1
        elif ch in _OPENERS:
            self.closers.append(_OPENERS[ch])
        elif ch in ")]}":
            if not self.closers:
                if ch == ")":
                    return True
                raise ValueError(f"unbalanced {ch!r} in an argument")
            if self.closers.pop() != ch:
                raise ValueError(f"mismatched {ch!r} in an argument")
        elif ch == "," and not self.closers:
            return True
        elif ch == "#":
            raise ValueError("a comment in a tool call")
        self.text.append(ch)
        return False

    def _string(self, ch: str) -> None:
        if self.escape:
            self.escape = False
        elif ch == "\\":
            self.escape, self.run = True, 0
        elif ch == self.quote[0]:
            self.run += 1
            if self.run == len(self.quote):
                self.quote, self.run = "", 0
        else:
            self.run = 0


class PythonicToolParser(ToolParser):
    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        # start (deciding), list states (item, name, open, arg, key, equals, value, next), after
        # (the list ended: leading whitespace, then content), text (content to the end)
        self._state = "start"
        self._word = ""  # a call's or argument's name so far
        self._index = 0  # the call being read
        self._args = Arguments()
        self._value = _Value()

    def _step(self) -> bool:
        if self._state == "text":
            self._content(self._buf)
            self._buf = ""
            return False
        head = self._buf.lstrip()
        if self._state in ("start", "after"):
            if not head:
                return False
            if self._state == "after" or head[0] != "[":
                self._content(head if self._state == "after" else self._buf)
                self._buf, self._state = "", "text"
                return False
            self._raw, self._buf, self._state = self._buf[: len(self._buf) - len(head) + 1], head[1:], "item"
            return True
        for i, ch in enumerate(self._buf):
            try:
                self._char(ch)
            except ValueError as exc:
                self._raw += self._buf[:i]
                self._fall_back(str(exc), self._buf[i:], started=self._started > 0)
                return False
            if self._state == "after":
                self._buf = self._buf[i + 1 :]
                return True
        self._raw += self._buf
        self._buf = ""
        return False

    def _char(self, ch: str) -> None:
        """One character of the list."""
        state = self._state
        if state == "value":
            if self._value.feed(ch):
                self._end_value(ch)
        elif state in ("name", "key") and (self._word + ch).isidentifier():
            self._word += ch
        elif ch.isspace() and state != "key":
            if state == "name":
                self._state = "open"
        elif state == "item" and ch.isidentifier():
            self._word, self._state = ch, "name"
        elif state == "item" and ch == "]" and self._started:  # (after a trailing comma)
            self._state = "after"
        elif state in ("name", "open") and ch == "(":
            if keyword.iskeyword(self._word):
                raise ValueError(f"{self._word!r} is not a function name")
            self._index, self._args, self._state = self._write_call(self._word), Arguments(), "arg"
        elif state == "arg" and ch.isidentifier():
            self._word, self._state = ch, "key"
        elif state == "arg" and ch == ")":
            self._close_call()
        elif state in ("key", "equals") and ch == "=":
            if keyword.iskeyword(self._word):
                raise ValueError(f"{self._word!r} is not an argument name")
            self._value, self._state = _Value(), "value"
        elif state == "key" and ch.isspace():
            self._state = "equals"
        elif state == "next" and ch in ",]":
            self._state = "item" if ch == "," else "after"
        else:
            raise ValueError(f"unexpected {ch!r} in a pythonic tool call list")

    def _end_value(self, ch: str) -> None:
        text = "".join(self._value.text)
        if not text.strip():
            raise ValueError(f"the argument {self._word!r} has no value")
        self._out.append(("args", self._index, self._args.member(self._word, python_literal(f"({text})"))))
        if ch == ")":
            self._close_call()
        else:
            self._state = "arg"

    def _close_call(self) -> None:
        self._out.append(("args", self._index, self._args.close()))
        self._state = "next"

    def _finish_text(self) -> None:
        if self._state == "start":
            self._content(self._buf)
        elif self._state not in ("after", "text"):
            self._fall_back("the output ends inside the tool call list", "", started=self._started > 0)
