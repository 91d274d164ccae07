"""The output of a grammar-forced tool choice (`required` or a named function): JSON the
constraint shaped, not a model family's format. A named choice's output is the arguments
object; `required`'s is an array of `{"name": ..., "arguments": {...}}` objects. Settled only
when the text ends (the JSON is complete only then); text that is not such JSON (cut by
max_tokens) stays content."""

from __future__ import annotations

import json

from pagoda.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolParser, call_from_json


class ForcedToolParser(ToolParser):
    name = "forced"

    def __init__(self, function_name: str | None) -> None:
        self.function_name = function_name  # None: `required`, any of the tools

    def parse(self, text: str, final: bool = True) -> ParsedOutput:
        if not final:
            return ParsedOutput("")
        try:
            value = json.loads(text)
        except ValueError:
            return ParsedOutput(text)
        if self.function_name is not None:
            value = [{"name": self.function_name, "arguments": value}]
        calls = [call_from_json(item, ("arguments",)) for item in value] if isinstance(value, list) else []
        if not calls or None in calls:
            return ParsedOutput(text)
        return ParsedOutput("", tuple(calls))
