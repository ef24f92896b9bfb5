"""An incremental JSON reader for tool calls that arrive a few characters at a time.

``JsonStream`` reads one JSON object or array, character by character, and writes it back as
``json.dumps(json.loads(text), ensure_ascii=False)`` would (no optional whitespace, ", " and
": " separators, numbers as Python writes them), piece by piece as it comes. Each piece is
tagged with the path of the value it belongs to (object keys and array indices from the top; a
container's own brackets, keys and separators carry the container's path), so a tool parser
can route the pieces of ``"arguments"`` to the call's arguments while they stream.

Because the pieces are the canonical text of what has been read so far, the arguments streamed
piece by piece add up to what one read of the whole text gives, however the text is split: the
streamed and the whole response cannot disagree. (vLLM's parsers re-parse the partial JSON at
every delta and stream the differences; this reads each character once.)
"""
from __future__ import annotations

import json
import re

Path = tuple[str | int, ...]
Piece = tuple[Path, str]

_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_WHITESPACE = frozenset(" \t\n\r")
_SURROGATE = re.compile("[\ud800-\udfff]")


class JsonError(ValueError):
    """The text is not (the start of) a JSON object or array."""


def dump_char(ch: str) -> str:
    """One decoded character as json.dumps(ensure_ascii=False) writes it inside a string; a lone
    surrogate (valid JSON, not valid UTF-8) stays an escape."""
    if 0xD800 <= ord(ch) <= 0xDFFF:
        return f"\\u{ord(ch):04x}"
    return json.dumps(ch, ensure_ascii=False)[1:-1]


def json_text(value: object) -> str:
    """``json.dumps(value, ensure_ascii=False)``, lone surrogates kept as escapes (as dump_char);
    ValueError for what JSON cannot hold (NaN, infinities, sets, bytes...)."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"not a JSON value: {exc}") from None
    return _SURROGATE.sub(lambda m: dump_char(m.group()), text)


class _Frame:
    """An object or array being read: its path, the member being read and what may come next."""

    __slots__ = ("is_object", "path", "key", "index", "expect")

    def __init__(self, is_object: bool, path: Path) -> None:
        self.is_object, self.path = is_object, path
        self.key: str = ""
        self.index = 0
        self.expect = "first"  # first (a key/value or the end), key, colon, value, next (a comma or the end)

    def member_path(self) -> Path:
        return (*self.path, self.key if self.is_object else self.index)


class JsonStream:
    """Reads one JSON object or array; ``feed`` takes text until the value ends."""

    def __init__(self) -> None:
        self.stack: list[_Frame] = []
        self.done = False
        self._token: str | None = None  # a scalar being read: "string", "key", "number" or "literal"
        self._path: Path = ()  # the scalar's path
        self._text = ""  # the number or literal so far
        self._escape: str | None = None  # a string escape so far ("\\", "\\u00"...)
        self._high: int | None = None  # a high surrogate waiting for its low half
        self._key: list[str] = []

    def feed(self, text: str) -> tuple[int, list[Piece]]:
        """Read ``text`` up to the end of the value: (characters read, pieces written). Raises
        JsonError where the text cannot continue a JSON object or array."""
        out: list[Piece] = []
        for i, ch in enumerate(text):
            if self.done:
                return i, out
            self._read(ch, out)
        return len(text), out

    def _read(self, ch: str, out: list[Piece]) -> None:
        if self._token in ("string", "key"):
            self._string_char(ch, out)
            return
        if self._token == "number":
            if ch in _NUMBER_CHARS:
                self._text += ch
                return
            self._end_number(out)  # then ch is read as what follows the number
        elif self._token == "literal":
            self._text += ch
            word = _LITERALS[self._text[0]]
            if not word.startswith(self._text):
                raise JsonError(f"expected {word!r}, got {self._text!r}")
            if self._text == word:
                self._token = None
                out.append((self._path, word))
                self._end_value()
            return
        if ch in _WHITESPACE:
            return
        if not self.stack:
            if ch not in "{[":
                raise JsonError(f"expected '{{' or '[', got {ch!r}")
            self._value(ch, (), out)
            return
        self._structural(ch, self.stack[-1], out)

    def _structural(self, ch: str, frame: _Frame, out: list[Piece]) -> None:
        expect, closer = frame.expect, "}" if frame.is_object else "]"
        if ch == closer and expect in ("first", "next"):
            out.append((frame.path, closer))
            self.stack.pop()
            self._end_value()
        elif expect == "next" and ch == ",":
            out.append((frame.path, ", "))
            if frame.is_object:
                frame.expect = "key"
            else:
                frame.index += 1
                frame.expect = "value"
        elif frame.is_object and expect in ("first", "key") and ch == '"':
            self._token, self._key = "key", []
        elif expect == "colon" and ch == ":":
            out.append((frame.path, ": "))
            frame.expect = "value"
        elif expect == "value" or (expect == "first" and not frame.is_object):
            self._value(ch, frame.member_path(), out)
        else:
            raise JsonError(f"unexpected {ch!r} in a JSON {'object' if frame.is_object else 'array'}")

    def _value(self, ch: str, path: Path, out: list[Piece]) -> None:
        if ch in "{[":
            out.append((path, ch))
            self.stack.append(_Frame(ch == "{", path))
        elif ch == '"':
            self._token, self._path = "string", path
            out.append((path, '"'))
        elif ch == "-" or ch.isdigit():
            self._token, self._path, self._text = "number", path, ch
        elif ch in _LITERALS:
            self._token, self._path, self._text = "literal", path, ch
        else:
            raise JsonError(f"expected a JSON value, got {ch!r}")

    def _end_value(self) -> None:
        if self.stack:
            self.stack[-1].expect = "next"
        else:
            self.done = True

    def _end_number(self, out: list[Piece]) -> None:
        self._token = None
        if not _NUMBER.fullmatch(self._text):
            raise JsonError(f"{self._text!r} is not a JSON number")
        try:
            out.append((self._path, json.dumps(json.loads(self._text))))
        except ValueError as exc:  # (past Python's digit limit)
            raise JsonError(str(exc)) from None
        self._end_value()

    def _string_char(self, ch: str, out: list[Piece]) -> None:
        if self._escape is not None:
            self._escape += ch
            if self._escape == "\\u" or (self._escape.startswith("\\u") and len(self._escape) < 6):
                return
            if self._escape.startswith("\\u"):
                try:
                    unit = int(self._escape[2:], 16)
                except ValueError:
                    raise JsonError(f"bad escape {self._escape!r}") from None
                self._escape = None
                self._unit(unit, out)
                return
            if ch not in _ESCAPES:
                raise JsonError(f"bad escape {self._escape!r}")
            self._escape = None
            self._unit(ord(_ESCAPES[ch]), out)
        elif ch == "\\":
            self._escape = "\\"
        elif ch == '"':
            self._flush_high(out)
            frame = self.stack[-1]
            if self._token == "key":
                frame.key = "".join(self._key)
                out.append((frame.path, '"' + "".join(map(dump_char, frame.key)) + '"'))
                frame.expect = "colon"
            else:
                out.append((self._path, '"'))
                self._end_value()
            self._token = None
        elif ord(ch) < 0x20:
            raise JsonError("a control character in a JSON string")
        else:
            self._unit(ord(ch), out)

    def _unit(self, unit: int, out: list[Piece]) -> None:
        """One UTF-16 code unit (or character) of a string: surrogate pairs are joined."""
        if self._high is not None and 0xDC00 <= unit <= 0xDFFF:
            unit, self._high = 0x10000 + ((self._high - 0xD800) << 10) + (unit - 0xDC00), None
        self._flush_high(out)
        if 0xD800 <= unit <= 0xDBFF:
            self._high = unit
        else:
            self._char(chr(unit), out)

    def _flush_high(self, out: list[Piece]) -> None:
        if self._high is not None:
            high, self._high = self._high, None
            self._char(chr(high), out)

    def _char(self, ch: str, out: list[Piece]) -> None:
        if self._token == "key":
            self._key.append(ch)
        else:
            out.append((self._path, dump_char(ch)))
