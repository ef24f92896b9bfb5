"""``--tool-call-parser mistral``: Mistral's tool calls (Mistral 7B Instruct v0.3, Nemo...,
with a Hugging Face tokenizer, as vLLM's parser reads them):

    Let me look that up.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

The text before ``[TOOL_CALLS]`` is the content; after it, a JSON array of calls (read as the
other JSON parsers read theirs: json_stream.py). As in Hermes's blocks, whitespace next to the
calls is dropped and text after them is content (vLLM would drop it). Each call's id is 9
letters and digits, the ids Mistral's chat template and mistral_common accept (as vLLM's).
"""
from __future__ import annotations

import random
import string

from vllmini.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

_ALPHANUMERIC = string.ascii_letters + string.digits


class MistralToolParser(Hermes2ProToolParser):
    """Hermes's reading with Mistral's tag, no closing tag, and an array of calls after it;
    the tag stays in the text as Hermes's (skip_special_tokens=False: it is a special token)."""

    START, END = "[TOOL_CALLS]", ""
    ARRAY = True

    def tool_call_id(self) -> str:
        return "".join(random.choices(_ALPHANUMERIC, k=9))
