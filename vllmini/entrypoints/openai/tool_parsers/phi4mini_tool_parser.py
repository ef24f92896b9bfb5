"""``--tool-call-parser phi4_mini_json``: Phi-4-mini's tool calls (a ``Phi3ForCausalLM``
model), as vLLM's parser reads them:

    functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]

The word ``functools`` (plain text, not a special token) then a JSON array of calls with a
``name`` and ``arguments`` (or ``parameters``). Read as Mistral's array after its tag: text
before the word is content, as is text after the array (vLLM's reading drops it).
"""
from __future__ import annotations

from vllmini.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser


class Phi4MiniJsonToolParser(Hermes2ProToolParser):
    START, END = "functools", ""
    ARRAY = True
