"""Tool-call parsers by name (vLLM's ``--tool-call-parser``), one module each."""
from __future__ import annotations

from vllmini.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser
from vllmini.entrypoints.openai.tool_parsers.ernie45_tool_parser import Ernie45ToolParser
from vllmini.entrypoints.openai.tool_parsers.glm4_moe_tool_parser import Glm45ToolParser
from vllmini.entrypoints.openai.tool_parsers.granite_tool_parser import GraniteToolParser
from vllmini.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from vllmini.entrypoints.openai.tool_parsers.llama_tool_parser import Llama3JsonToolParser
from vllmini.entrypoints.openai.tool_parsers.mistral_tool_parser import MistralToolParser
from vllmini.entrypoints.openai.tool_parsers.openai_tool_parser import OpenAIToolParser
from vllmini.entrypoints.openai.tool_parsers.phi4mini_tool_parser import Phi4MiniJsonToolParser
from vllmini.entrypoints.openai.tool_parsers.pythonic_tool_parser import PythonicToolParser
from vllmini.entrypoints.openai.tool_parsers.qwen3coder_tool_parser import Qwen3CoderToolParser
from vllmini.entrypoints.openai.tool_parsers.xlam_tool_parser import XLAMToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "ernie45": Ernie45ToolParser,
    "glm45": Glm45ToolParser,
    "granite": GraniteToolParser,
    "hermes": Hermes2ProToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,  # (vLLM's name for the same format on Llama 4)
    "mistral": MistralToolParser,
    "openai": OpenAIToolParser,  # (gpt-oss's harmony tool calls)
    "phi4_mini_json": Phi4MiniJsonToolParser,
    "pythonic": PythonicToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "qwen3_xml": Qwen3CoderToolParser,  # (vLLM's second parser of the same Qwen3-Coder format)
    "xlam": XLAMToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class of ``--tool-call-parser NAME``; ValueError naming the choices."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser: unknown parser {name!r} (choose from {', '.join(TOOL_PARSERS)})")
    return TOOL_PARSERS[name]


__all__ = ["TOOL_PARSERS", "ToolParser", "Ernie45ToolParser", "Glm45ToolParser", "GraniteToolParser", "Hermes2ProToolParser", "Llama3JsonToolParser", "MistralToolParser", "OpenAIToolParser",
           "Phi4MiniJsonToolParser", "PythonicToolParser", "Qwen3CoderToolParser", "XLAMToolParser", "get_tool_parser"]
