"""Llama 3.1/3.2/3.3 JSON calls: the answer is one or more `{"name": ..., "parameters": {...}}`
objects (separated by `;`), optionally after `<|python_tag|>`; an answer that does not start
with an object is content. Text after the last call that is not one stays content."""

from __future__ import annotations

import json

from pagoda.entrypoints.openai.tool_parsers.base import ParsedOutput, ParsedToolCall, ToolParser, call_from_json

PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = " \t\r\n;"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool = True) -> ParsedOutput:
        stripped = text.lstrip()
        if not final and PYTHON_TAG.startswith(stripped):
            return ParsedOutput("")  # nothing yet says whether calls come
        position = len(text) - len(stripped)
        if stripped.startswith(PYTHON_TAG):
            position += len(PYTHON_TAG)
        elif not stripped.startswith("{"):
            return ParsedOutput(text)
        calls: list[ParsedToolCall] = []
        decoder = json.JSONDecoder()
        while True:
            while position < len(text) and text[position] in _SEPARATORS:
                position += 1
            if position == len(text):
                return ParsedOutput("", tuple(calls))
            try:
                value, end = decoder.raw_decode(text, position)
            except ValueError:  # an object still growing, or malformed
                value, end = None, position
            call = call_from_json(value)
            if call is None:
                return ParsedOutput(text[position:] if final else "", tuple(calls))
            calls.append(call)
            position = end
