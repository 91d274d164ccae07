"""One choice's text as an assistant message: reasoning first (a reasoning parser splits it
off), then the answer's tool calls (a tool-call parser). Parts are stripped of surrounding
whitespace, which streaming holds back until the next text shows it is inside a part.

`MessageParser.update` takes a choice's text as it grows and returns what the client has not
seen yet; the deltas join to what `parse` gives for the whole text (both read the parsers'
settled output), so a stream and a plain answer say the same."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.entrypoints.openai.reasoning import ReasoningParser
from pagoda.entrypoints.openai.tool_parsers import ParsedToolCall, ToolParser


@dataclass(frozen=True)
class ParsedMessage:
    content: str
    reasoning: str
    calls: tuple[ParsedToolCall, ...] = ()


class _StrippedText:
    """A growing text's new characters, with its leading whitespace dropped and its trailing
    whitespace held until more text (or the end) decides it."""

    def __init__(self) -> None:
        self.sent = 0

    def new(self, text: str) -> str:
        """`text` is the whole text so far; a stripped prefix of a text is a prefix of its stripped whole."""
        piece = text.strip()[self.sent :]
        self.sent += len(piece)
        return piece


class MessageParser:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self._content = _StrippedText()
        self._reasoning = _StrippedText()
        self._num_calls = 0

    def _settled(self, text: str, final: bool) -> ParsedMessage:
        reasoning, answer = "", text
        if self.reasoning is not None:
            split = self.reasoning.split(text, final)
            reasoning, answer = split.reasoning, split.content
        if self.tools is None:
            return ParsedMessage(answer, reasoning)
        parsed = self.tools.parse(answer, final)
        return ParsedMessage(parsed.content, reasoning, parsed.calls)

    def parse(self, text: str) -> ParsedMessage:
        """The whole text's message, its parts stripped."""
        message = self._settled(text, final=True)
        return ParsedMessage(message.content.strip(), message.reasoning.strip(), message.calls)

    def update(self, text: str, final: bool) -> ParsedMessage:
        """What `text` (the choice's text so far; `final` once it is whole) adds to the message."""
        message = self._settled(text, final)
        calls = message.calls[self._num_calls :]
        self._num_calls = len(message.calls)
        return ParsedMessage(self._content.new(message.content), self._reasoning.new(message.reasoning), calls)
