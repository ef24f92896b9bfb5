"""``--tool-call-parser glm45``: GLM-4.5 / 4.6's tool calls (its chat template's), as vLLM's
``Glm4MoeModelToolParser`` reads them:

    Let me look that up.
    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

One call per Hermes block (hermes_tool_parser.py reads the blocks): the function's name up to
the line's end, then ``<arg_key>`` / ``<arg_value>`` pairs. A value is its text, stripped; typed
as vLLM does: kept as text where the request's schema says ``"type": "string"``, else read as
JSON, then as JSON after unescaping (a value written inside a JSON string), then as a Python
literal, else kept as text. As vLLM's, the content is the text before the first call, and the
tags are plain text in GLM's output (special tokens are skipped as the request asks). Unlike
vLLM's, a call whose name is followed straight by ``</tool_call>`` (no newline) is read, with no
arguments, and a call that is not this format makes the whole output content, streamed too until
the call's name was sent (then the rest), where vLLM's streamed reading drops such a call.
"""
from __future__ import annotations

import json
from typing import Any

from vllmini.engine.sampling_params import SamplingParams
from vllmini.entrypoints.openai.tool_parsers.abstract_tool_parser import Arguments, python_literal
from vllmini.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from vllmini.entrypoints.openai.tool_parsers.qwen3coder_tool_parser import Qwen3CoderToolParser, parameter_schemas


def glm_value(text: str, schema: Any) -> Any:
    """An ``<arg_value>``'s stripped text as the value vLLM's glm45 parser makes of it."""
    if isinstance(schema, dict) and schema.get("type") == "string":
        return text
    for read in (json.loads, lambda t: json.loads(json.loads('"' + t + '"')), python_literal):
        try:
            return read(text)
        except (ValueError, TypeError, RecursionError):
            pass
    return text


class Glm45ToolParser(Qwen3CoderToolParser):
    """Qwen3-Coder's XML reader (its states and typed members) over GLM's tags."""

    ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
    TEXT_AFTER_CALLS = False
    _step = Hermes2ProToolParser._step  # (one call per block)

    def adjust_request(self, params: SamplingParams) -> SamplingParams:
        return params

    def _xml_step(self, text: str) -> int | None:
        state, head = self._xml, text.lstrip()
        skipped = len(text) - len(head)
        if state == "open":  # the name, up to the line's end (or the first tag)
            ends = [i for tag in ("\n", self.ARG_KEY, self.END) if (i := text.find(tag)) >= 0]
            if not ends:
                return None
            name = text[: min(ends)].strip()
            if not name or "<" in name:
                raise ValueError(f"a bad function name {text[: min(ends)]!r}")
            self._index, self._args = self._write_call(name), Arguments()
            self._schemas, self._xml = parameter_schemas(self.tools, name), "body"
            return min(ends)
        if state in ("body", "keyed"):
            tags = (self.ARG_KEY, self.END) if state == "body" else (self.ARG_VALUE,)
            tag = next((t for t in tags if head.startswith(t)), None)
            if tag is None:
                if any(t.startswith(head) for t in tags):
                    return None
                raise ValueError(f"expected {' or '.join(tags)} in a tool call, got {head[:20]!r}")
            if tag == self.END:  # (left for the block's reader to close)
                self._out.append(("args", self._index, self._args.close()))
                self._xml = "done"
                return skipped
            self._xml, self._searched = ("key" if tag == self.ARG_KEY else "value"), 0
            return skipped + len(tag)
        end_tag = self.ARG_KEY_END if state == "key" else self.ARG_VALUE_END
        end = text.find(end_tag, max(0, self._searched - len(end_tag)))
        if end < 0:
            self._searched = len(text)
            return None
        if state == "key":
            self._key, self._xml = text[:end].strip(), "keyed"
        else:
            typed = glm_value(text[:end].strip(), self._schemas.get(self._key))
            self._out.append(("args", self._index, self._args.member(self._key, typed)))
            self._xml = "body"
        return end + len(end_tag)
