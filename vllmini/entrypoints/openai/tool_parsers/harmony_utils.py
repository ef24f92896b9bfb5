"""gpt-oss's "harmony" output read from its text (vLLM reads it with the ``openai_harmony``
package, which fetches its vocabulary at run time; here the special tokens are kept in the text,
``skip_special_tokens=False``, and read as tags). An output is messages:

    <|channel|>analysis<|message|>reasoning<|end|><|start|>assistant<|channel|>final<|message|>answer<|return|>
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

A header (``<|start|>ROLE`` and/or ``<|channel|>CHANNEL``, a recipient ``to=NAME`` after either)
ends at ``<|message|>``; the body ends at ``<|end|>``, ``<|call|>`` or ``<|return|>`` (the last two
are EOS tokens, so usually missing) or where a new header starts. The generation prompt ends with
``<|start|>assistant``, so an output opens with the first header's rest (``<|channel|>...``, or a
recipient: `` to=functions.NAME<|channel|>commentary json<|message|>``). Text outside any message
(an output without tags) is read as such. ``HarmonyReader`` turns the text into events, fed a
delta at a time (a tag split across deltas is held back, a header until it is whole), so the
readings of a whole output and of any split of it into deltas are the same.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

from vllmini.entrypoints.openai.tool_parsers.abstract_tool_parser import partial_tag

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
ENDS = (END, CALL, RETURN)
TAGS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
FUNCTIONS = "functions."  # the recipient prefix of the request's tools (others are built-in tools)

_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_ROLE_RECIPIENT = re.compile(r"to=[^\s<]*\s*")


@dataclass(frozen=True)
class Header:
    """A message's header: its text through ``<|message|>``, channel and recipient (None: not given)."""

    raw: str
    channel: str | None
    recipient: str | None

    @classmethod
    def parse(cls, raw: str) -> Header:
        channel, recipient = _CHANNEL.search(raw), _RECIPIENT.search(raw)
        return cls(raw, channel.group(1) if channel else None, recipient.group(1) if recipient else None)

    @property
    def function(self) -> str | None:
        """The called function's name, for a message addressed ``to=functions.NAME``."""
        if self.recipient is not None and self.recipient.startswith(FUNCTIONS) and self.recipient != FUNCTIONS:
            return self.recipient[len(FUNCTIONS) :]
        return None

    def written(self) -> str:
        """The header as a whole message's (``<|start|>`` first), whatever part the prompt wrote."""
        recipient = f" to={self.recipient}" if self.recipient else ""
        return f"{START}assistant{CHANNEL}{self.channel or 'commentary'}{recipient}{MESSAGE}"

    @property
    def kind(self) -> str:
        """What the body is, as vLLM reads it: "call" (to a function, on any channel), "reasoning"
        (analysis, built-in tools' calls too), "content" (final, and commentary to no one: a
        preamble shown to the user) or "other" (commentary to a built-in tool, unknown channels)."""
        if self.function is not None:
            return "call"
        if self.channel == "analysis":
            return "reasoning"
        if self.channel == "final" or (self.channel == "commentary" and self.recipient is None):
            return "content"
        return "other"


ANALYSIS = Header("", "analysis", None)  # the message a prompt ending in <|channel|>analysis<|message|> leaves open

# ("text", s): outside any message; ("dropped", s): a stray tag or a header that never reached
# <|message|>; ("header", Header); ("body", s); ("end", tag): the body ended (tag "": by a new header)
Event = Union[tuple[str, str], tuple[str, Header]]


def _may_go_on_role(text: str) -> bool:
    """Whether ``text`` may be (the start of) what follows the role in a header: a recipient."""
    rest = text.lstrip()
    return "to=".startswith(rest) or _ROLE_RECIPIENT.fullmatch(rest) is not None


class HarmonyReader:
    """The events of an output's text, a delta at a time; ``message``: the header of the body
    being read (None outside one), given to start inside a body."""

    def __init__(self, message: Header | None = None) -> None:
        self.message = message
        self._header: str | None = None  # the header read so far, while in one
        self._opening = message is None  # the output may go on the prompt's <|start|>assistant: " to=NAME<|channel|>..."
        self._buf = ""
        self._events: list[Event] = []

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        while self._step():
            pass
        return self._take()

    def finish(self) -> list[Event]:
        """The held-back text, once the output is complete (a header cut short is dropped)."""
        if self._header is not None:
            self._emit("dropped", self._header + self._buf)
        else:
            self._emit("body" if self.message is not None else "text", self._buf)
        self._buf, self._header = "", None
        return self._take()

    def _step(self) -> bool:
        found = [(i, tag) for tag in TAGS if (i := self._buf.find(tag)) >= 0]
        # (without a tag, the end that may begin one is held back)
        keep = len(self._buf) - max(partial_tag(self._buf, tag) for tag in TAGS) if not found else 0
        if self._opening:
            if not found and _may_go_on_role(self._buf[:keep]):
                return False
            self._opening = False
            if found and min(found)[1] in (CHANNEL, CONSTRAIN, MESSAGE) and _may_go_on_role(self._buf[: min(found)[0]]):
                self._header = ""  # (the text before the tag is the header's, after the prompt's role)
        if not found:
            self._text(self._buf[:keep])
            self._buf = self._buf[keep:]
            return False
        i, tag = min(found)
        self._text(self._buf[:i])
        self._buf = self._buf[i + len(tag) :]
        self._tag(tag)
        return True

    def _text(self, text: str) -> None:
        if self._header is not None:
            self._header += text
        else:
            self._emit("body" if self.message is not None else "text", text)

    def _tag(self, tag: str) -> None:
        if self._header is not None:  # in a header
            if tag == MESSAGE:
                self.message, self._header = Header.parse(self._header + tag), None
                self._events.append(("header", self.message))
            elif tag in (START, *ENDS):  # (a header without its message)
                self._emit("dropped", self._header + ("" if tag == START else tag))
                self._header = tag if tag == START else None
            else:
                self._header += tag
        elif self.message is not None:  # in a body
            if tag in ENDS or tag in (START, CHANNEL):
                self._events.append(("end", tag if tag in ENDS else ""))
                self.message = None
                if tag in (START, CHANNEL):  # (a new message without the last one's <|end|>)
                    self._header = tag
            else:
                self._emit("body", tag)
        elif tag in (START, CHANNEL):
            self._header = tag
        else:
            self._emit("dropped", tag)

    def _emit(self, kind: str, text: str) -> None:
        if text:
            self._events.append((kind, text))

    def _take(self) -> list[Event]:
        out, self._events = self._events, []
        return out
