"""Tool-call parsers by name (`--tool-call-parser`), and the default for a model: its chat
template's own call format (`[TOOL_CALLS]` is Mistral's, `<|python_tag|>` Llama 3's), else
hermes (`<tool_call>`: Qwen's, and the fallback tool prompt's)."""

from __future__ import annotations

from pagoda.entrypoints.openai.tool_parsers.base import ParsedOutput, ParsedToolCall, ToolParser
from pagoda.entrypoints.openai.tool_parsers.forced import ForcedToolParser
from pagoda.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagoda.entrypoints.openai.tool_parsers.llama3_json import PYTHON_TAG, Llama3JsonToolParser
from pagoda.entrypoints.openai.tool_parsers.mistral import MARKER, MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def default_tool_parser(chat_template: str | None) -> str:
    """The parser for a model whose chat template is `chat_template` (see the module's rule)."""
    template = chat_template or ""
    if MARKER in template:
        return MistralToolParser.name
    if PYTHON_TAG in template:
        return Llama3JsonToolParser.name
    return HermesToolParser.name


__all__ = [
    "TOOL_PARSERS",
    "ForcedToolParser",
    "ParsedOutput",
    "ParsedToolCall",
    "ToolParser",
    "default_tool_parser",
]
