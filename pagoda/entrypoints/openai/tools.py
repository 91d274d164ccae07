"""A request's function tools and tool_choice, checked, and what they ask of the engine and of
the output's parsing (chat's and the Responses API's alike; `ToolFields` names each route's
fields in errors):

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
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, FunctionDefinition, NamedToolChoice
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
class ToolFields:
    """How a route names tool fields in errors: `function` a tool's function object (`{}` its
    index), `choice_name` the function a tool_choice names."""

    function: str
    choice_name: str


CHAT_TOOL_FIELDS = ToolFields("tools[{}].function", "tool_choice.function.name")


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[dict[str, Any], ...]  # OpenAI's tool objects, as chat templates take them
    choice: str  # "none", "auto", "required" or a function's name
    parallel: bool
    fields: ToolFields = CHAT_TOOL_FIELDS

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    def constraint(self) -> Constraint | None:
        """The structured output a forced choice needs (None for none and auto)."""
        if self.choice in ("none", "auto"):
            return None
        if self.choice != "required":
            index = next(i for i, tool in enumerate(self.tools) if tool["function"]["name"] == self.choice)
            return json_constraint(parameters(self.tools[index]), f"{self.fields.function.format(index)}.parameters")
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


def chat_tool_plan(body: ChatCompletionRequest) -> ToolPlan | None:
    """A chat request's tools and choice, checked (400 naming the field); None without tools."""
    choice = body.tool_choice
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    mode = None if isinstance(choice, NamedToolChoice) else choice
    functions = [tool.function for tool in body.tools or []]
    return tool_plan(functions, mode, named, body.parallel_tool_calls, CHAT_TOOL_FIELDS)


def tool_plan(
    functions: list[FunctionDefinition],
    mode: str | None,
    named: str | None,
    parallel_tool_calls: bool | None,
    fields: ToolFields,
) -> ToolPlan | None:
    """The functions and the choice (`mode` "none", "auto" or "required", or the function
    `named`), checked (400 naming the field); None without functions."""
    if not functions:
        # "none" and "auto" ask for nothing without functions; a call cannot be forced.
        if named is not None or mode == "required":
            raise OpenAIError(400, "tool_choice needs tools: send the functions it may call", "tool_choice")
        return None
    if len(functions) > MAX_TOOLS:
        raise OpenAIError(400, f"tools has {len(functions)} tools; at most {MAX_TOOLS} are accepted", "tools")
    names: set[str] = set()
    for i, function in enumerate(functions):
        _check_function(fields.function.format(i), function, names)
    if named is None:
        choice = mode or "auto"
    elif named not in names:
        raise OpenAIError(
            400,
            f"tool_choice names the function {named!r}, which is not among the tools ({', '.join(sorted(names))})",
            fields.choice_name,
        )
    else:
        choice = named
    tools = tuple({"type": "function", "function": function.model_dump(exclude_none=True)} for function in functions)
    return ToolPlan(tools, choice, parallel_tool_calls is not False, fields)


def _check_function(field: str, function: FunctionDefinition, names: set[str]) -> None:
    name = function.name
    if not _FUNCTION_NAME.fullmatch(name):
        raise OpenAIError(
            400, f"{field}.name must be 1 to 64 letters, digits, '_' or '-', got {name[:80]!r}", f"{field}.name"
        )
    if name in names:
        raise OpenAIError(400, f"{field}.name {name!r} is given twice: function names must be unique", f"{field}.name")
    names.add(name)
    if function.parameters is not None:
        check_schema(function.parameters, f"{field}.parameters")
        kind = function.parameters.get("type", "object")
        if kind != "object":
            raise OpenAIError(
                400,
                f"{field}.parameters must describe an object (type 'object'), got type {kind!r}",
                f"{field}.parameters",
            )


def call_id() -> str:
    """A fresh tool-call id, in OpenAI's shape."""
    return f"call_{secrets.token_hex(12)}"
