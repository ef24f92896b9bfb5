"""``--tool-call-parser ernie45``: ERNIE 4.5's tool calls (its Thinking model's template), as
vLLM's parser reads them:

    I should look that up.
    </think>


    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Hermes' blocks (hermes_tool_parser.py reads them), each one call's JSON. With ``--reasoning-parser
ernie45`` the reasoning (and the newlines after ``</think>``) is taken out first; without it the text
through ``</think>`` is the content, as in vLLM.
"""
from __future__ import annotations

from vllmini.engine.sampling_params import SamplingParams
from vllmini.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser


class Ernie45ToolParser(Hermes2ProToolParser):
    """As vLLM's: the content is the text before the first call (trailing whitespace dropped), the
    text after it is not content, and the tags are plain text in ERNIE's output (special tokens are
    skipped as the request asks). Unlike vLLM's, a block's closing tag may be left out (as
    hermes'), a call without a name makes the output content (vLLM's names it ""), and
    ``<response>`` tags are the reasoning parser's to take out (vLLM's streamed reading drops
    them here too, its whole reading does not)."""

    TEXT_AFTER_CALLS = False

    def adjust_request(self, params: SamplingParams) -> SamplingParams:
        return params
