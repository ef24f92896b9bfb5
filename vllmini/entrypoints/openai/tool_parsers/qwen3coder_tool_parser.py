"""``--tool-call-parser qwen3_coder``: Qwen3-Coder's XML tool calls, as vLLM's parser reads them:

    Let me look that up.
    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

The blocks and the text around them are read as Hermes's (hermes_tool_parser.py); a block holds
one or more ``<function=NAME>`` elements. A parameter's value is its text (one newline after
the opening tag and one before the closing tag left out; a missing ``</parameter>`` ends at the
next parameter or ``</function>``), typed by the parameter's JSON schema in the request's
``tools`` as vLLM does (``convert``): "null" is None; strings stay text; integers, numbers and
booleans are read as such (text that is none stays text); objects and arrays are read as JSON,
then as a Python literal; a parameter the schema does not name stays text. A call's name is
written at its ``>``, its arguments a parameter at a time. A block that is not this XML (or
names a parameter twice) makes the output content, as a broken Hermes block does.
"""
from __future__ import annotations

import json
import math
from typing import Any

from vllmini.entrypoints.openai.tool_parsers.abstract_tool_parser import Arguments, python_literal
from vllmini.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

_STRINGS = ("string", "str", "text", "varchar", "char", "enum")
_INTEGERS = ("int", "uint", "long", "short", "unsigned")
_NUMBERS = ("num", "float")
_BOOLEANS = ("boolean", "bool", "binary")
_CONTAINERS = ("object", "array", "arr", "dict", "list")


def parameter_schemas(tools: list[dict[str, Any]] | None, name: str) -> dict[str, Any]:
    """The schemas of a function's parameters, by name ({} for a function not in ``tools``)."""
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            params = function.get("parameters")
            if not isinstance(params, dict):
                return {}
            properties = params.get("properties", params)  # (as vLLM: a bare map of parameters too)
            return properties if isinstance(properties, dict) else {}
    return {}


def convert(value: str, schema: Any) -> Any:
    """A parameter's text as the value its schema's ``type`` names (vLLM's conversions)."""
    if value.lower() == "null":
        return None
    kind = str(schema["type"]).strip().lower() if isinstance(schema, dict) and "type" in schema else "string"
    if kind in _STRINGS:
        return value
    if kind.startswith(_INTEGERS):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(_NUMBERS):
        try:
            number = float(value)
        except ValueError:
            return value
        return value if not math.isfinite(number) else int(number) if number.is_integer() else number
    if kind in _BOOLEANS:
        return value.lower() == "true"
    if kind in _CONTAINERS[:3] or kind.startswith(_CONTAINERS[3:]):
        try:
            return json.loads(value)
        except ValueError:
            pass
    try:
        return python_literal(value)
    except ValueError:
        return value


class Qwen3CoderToolParser(Hermes2ProToolParser):
    FUNCTION, FUNCTION_END = "<function=", "</function>"
    PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
    _VALUE_ENDS = (PARAMETER_END, PARAMETER, FUNCTION_END)

    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        # the call's XML: None outside it, then open, name, body (between parameters), key, value, done
        self._xml: str | None = None
        self._index = 0
        self._args = Arguments()
        self._schemas: dict[str, Any] = {}
        self._key = ""
        self._searched = 0  # characters of the value searched for its end

    def _step(self) -> bool:
        if self._closing:  # (another function in the same block)
            rest = self._buf.lstrip()
            if rest.startswith(self.FUNCTION):
                self._closing, self._buf = False, rest
                self._begin_call("")
                return True
            if rest and self.FUNCTION.startswith(rest):
                return False
        return super()._step()

    def _begin_call(self, raw: str, array: bool = False) -> None:
        self._xml, self._raw, self._call_written = "open", raw, False

    @property
    def _in_call(self) -> bool:
        return self._xml not in (None, "done")

    def _read_call(self, text: str) -> int:
        pos = 0
        try:
            while self._in_call:
                n = self._xml_step(text[pos:])
                if n is None:
                    break
                pos += n
        except ValueError as exc:
            self._raw += text[:pos]
            self._fall_back(str(exc), text[pos:])
            return len(text)
        self._raw += text[:pos]
        return pos

    def _xml_step(self, text: str) -> int | None:
        """Read the start of ``text``: the characters read (None: wait for more)."""
        state, head = self._xml, text.lstrip()
        skipped = len(text) - len(head)
        if state in ("open", "body"):
            tags = (self.FUNCTION,) if state == "open" else (self.PARAMETER, self.FUNCTION_END)
            tag = next((t for t in tags if head.startswith(t)), None)
            if tag is None:
                if any(t.startswith(head) for t in tags):
                    return None
                raise ValueError(f"expected {' or '.join(tags)} in a tool call, got {head[:20]!r}")
            if tag == self.FUNCTION_END:
                self._out.append(("args", self._index, self._args.close()))
            self._xml = {self.FUNCTION: "name", self.PARAMETER: "key", self.FUNCTION_END: "done"}[tag]
            return skipped + len(tag)
        if state in ("name", "key"):
            end = text.find(">")
            if end < 0:
                return None
            name = text[:end].strip()
            if not name or "<" in name:
                raise ValueError(f"a bad {'function' if state == 'name' else 'parameter'} name {text[:end]!r}")
            if state == "name":
                self._index, self._args = self._write_call(name), Arguments()
                self._schemas = parameter_schemas(self.tools, name)
            self._key, self._xml, self._searched = name, "body" if state == "name" else "value", 0
            return end + 1
        return self._value(text)

    def _value(self, text: str) -> int | None:
        start = max(0, self._searched - len(self.PARAMETER_END))
        found = [(i, tag) for tag in self._VALUE_ENDS if (i := text.find(tag, start)) >= 0]
        if not found:
            self._searched = len(text)
            return None
        end, tag = min(found)
        value = text[:end].removeprefix("\n").removesuffix("\n")
        typed = convert(value, self._schemas.get(self._key))
        self._out.append(("args", self._index, self._args.member(self._key, typed)))
        self._xml = "body"
        return end + len(tag) if tag == self.PARAMETER_END else end
