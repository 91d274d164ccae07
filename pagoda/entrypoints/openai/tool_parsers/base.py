"""What every tool-call parser shares: the parsed call, the parsed output, and the parser's one
method. A parser reads a choice's text and splits it into content and calls.

`parse(text, final=False)` returns only the *settled* part of a text still growing: what no
later text can change (a call whose block is complete, content that cannot be the start of a
call marker). So the outputs of a growing text are prefixes of the final one, and a stream
built from them joins to the answer given without streaming, character for character.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it


@dataclass(frozen=True)
class ParsedOutput:
    content: str  # the text outside the calls, unstripped
    calls: tuple[ParsedToolCall, ...] = ()


class ToolParser(ABC):
    name: ClassVar[str]
    # Whether the model's call marker is a special token, which the output text must keep
    # (the request's skip_special_tokens then defaults to false).
    needs_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def parse(self, text: str, final: bool = True) -> ParsedOutput:
        """The settled part of `text` as content and calls; with `final`, all of it."""


def call_from_json(value: Any, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedToolCall | None:
    """A call from a decoded `{"name": ..., "arguments": {...}}` object (arguments may also come
    as a JSON object's text, as some models write them); None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    key = next((key for key in argument_keys if key in value), None)
    arguments = value[key] if key is not None else {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def decode_call(text: str) -> ParsedToolCall | None:
    """The call one JSON object's text holds, or None (malformed JSON, not a call)."""
    try:
        return call_from_json(json.loads(text))
    except ValueError:
        return None
