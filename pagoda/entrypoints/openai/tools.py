"""A chat request's tools and tool_choice, checked, and what they ask of the engine and of
the output's parsing:

- `none` (or no tools): the tools are shown to the model, its text is not parsed for calls;
- `auto` (the default with tools): the text is parsed by the model family's tool-call parser;
- `required` and a named function: the output is grammar-constrained to calls, as JSON
  (structured outputs, not a family's call markers): a named choice's output is that
  function's arguments object; `required`'s an array of `{"name", "arguments"}` objects, of
  exactly one call, or 1 to MAX_PARALLEL_TOOL_CALLS when parallel_tool_calls is true (the default).
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any

from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, ChatTool
from pagoda.entrypoints.openai.structured import Constraint, check_schema, json_constraint
from pagoda.entrypoints.openai.tool_parsers import ForcedToolParser, ToolParser

# OpenAI's bounds: 128 tools, names of letters, digits, _ and -, 64 at most.
MAX_TOOLS = 128
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Calls one forced answer may hold: an array without an end could run to max_tokens.
MAX_PARALLEL_TOOL_CALLS = 16
# A function that declares no parameters takes an empty arguments object.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[dict[str, Any], ...]  # OpenAI's tool objects, as chat templates take them
    choice: str  # "none", "auto", "required" or a function's name
    parallel: bool

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    def constraint(self) -> Constraint | None:
        """The structured output a forced choice needs (None for none and auto)."""
        if self.choice in ("none", "auto"):
            return None
        if self.choice != "required":
            index = next(i for i, tool in enumerate(self.tools) if tool["function"]["name"] == self.choice)
            return json_constraint(parameters(self.tools[index]), f"tools[{index}].function.parameters")
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": tool["function"]["name"]}, "arguments": parameters(tool)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for tool in self.tools
        ]
        schema = {
            "type": "array",
            "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
            "minItems": 1,
            "maxItems": MAX_PARALLEL_TOOL_CALLS if self.parallel else 1,
        }
        return json_constraint(schema, "tools")

    def forced_parser(self) -> ToolParser | None:
        """The parser of a forced choice's output (None for none and auto)."""
        if self.choice in ("none", "auto"):
            return None
        return ForcedToolParser(None if self.choice == "required" else self.choice)


def parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or NO_PARAMETERS


def tool_plan(body: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tools and choice, checked (400 naming the field); None without tools."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise OpenAIError(400, "tool_choice needs tools: send the functions it may call", "tool_choice")
        return None
    if len(body.tools) > MAX_TOOLS:
        raise OpenAIError(400, f"tools has {len(body.tools)} tools; at most {MAX_TOOLS} are accepted", "tools")
    names: set[str] = set()
    for i, tool in enumerate(body.tools):
        _check_tool(i, tool, names)
    if isinstance(choice, str) or choice is None:
        mode = choice or "auto"
    elif choice.function.name not in names:
        raise OpenAIError(
            400,
            f"tool_choice names the function {choice.function.name!r}, which is not among the tools "
            f"({', '.join(sorted(names))})",
            "tool_choice.function.name",
        )
    else:
        mode = choice.function.name
    tools = tuple(tool.model_dump(exclude_none=True) for tool in body.tools)
    return ToolPlan(tools, mode, body.parallel_tool_calls is not False)


def _check_tool(index: int, tool: ChatTool, names: set[str]) -> None:
    name = tool.function.name
    field = f"tools[{index}].function"
    if not _FUNCTION_NAME.fullmatch(name):
        raise OpenAIError(
            400, f"{field}.name must be 1 to 64 letters, digits, '_' or '-', got {name[:80]!r}", f"{field}.name"
        )
    if name in names:
        raise OpenAIError(400, f"{field}.name {name!r} is given twice: function names must be unique", f"{field}.name")
    names.add(name)
    if tool.function.parameters is not None:
        check_schema(tool.function.parameters, f"{field}.parameters")
        kind = tool.function.parameters.get("type", "object")
        if kind != "object":
            raise OpenAIError(
                400,
                f"{field}.parameters must describe an object (type 'object'), got type {kind!r}",
                f"{field}.parameters",
            )


def call_id() -> str:
    """A fresh tool-call id, in OpenAI's shape."""
    return f"call_{secrets.token_hex(12)}"
