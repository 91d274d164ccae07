"""Mistral calls: content, then the `[TOOL_CALLS]` special token and a JSON array of
`{"name": ..., "arguments": {...}}` objects (one object alone is taken too), or, in the v11
tokenizer's format, `[TOOL_CALLS]name[ARGS]{...}` per call. What follows the marker and is not
a call stays content."""

from __future__ import annotations

import json
import re

from pagoda.entrypoints.openai.text_prefix import pending_stop_prefix
from pagoda.entrypoints.openai.tool_parsers.base import ParsedOutput, ParsedToolCall, ToolParser, call_from_json

MARKER = "[TOOL_CALLS]"
_NAMED_ARGS = re.compile(r"\s*([A-Za-z0-9_.\-]+)\[ARGS\]")


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def parse(self, text: str, final: bool = True) -> ParsedOutput:
        first = text.find(MARKER)
        if first < 0:
            return ParsedOutput(text if final else text[: len(text) - pending_stop_prefix(text, [MARKER])])
        calls: list[ParsedToolCall] = []
        position = first
        while True:
            while text.startswith(MARKER, position) or text[position : position + 1].isspace():
                position += len(MARKER) if text.startswith(MARKER, position) else 1
            if position == len(text):
                return ParsedOutput(text[:first], tuple(calls))
            found, end = _calls_at(text, position)
            if found is None:
                return ParsedOutput(text[:first] + (text[position:] if final else ""), tuple(calls))
            calls += found
            position = end


def _calls_at(text: str, position: int) -> tuple[list[ParsedToolCall] | None, int]:
    """The calls written at `position` (an array, one object, or `name[ARGS]{...}`) and where
    they end; None while they are incomplete or if they are not calls."""
    decoder = json.JSONDecoder()
    named = _NAMED_ARGS.match(text, position)
    try:
        value, end = decoder.raw_decode(text, named.end() if named else position)
    except ValueError:
        return None, position
    if named is not None:
        value = {"name": named.group(1), "arguments": value}
    items = value if isinstance(value, list) else [value]
    calls = [call_from_json(item) for item in items]
    if not calls or None in calls:
        return None, position
    return calls, end
