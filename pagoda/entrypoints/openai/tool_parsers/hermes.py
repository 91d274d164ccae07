"""Hermes-style calls, as Qwen2/2.5/3 and Hermes models write them (and as the fallback tool
prompt asks): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them,
with text around. A block that does not hold a call (malformed JSON, no name) stays content;
the last block may lack its closing tag when the text ends."""

from __future__ import annotations

from pagoda.entrypoints.openai.text_prefix import pending_stop_prefix
from pagoda.entrypoints.openai.tool_parsers.base import ParsedOutput, ParsedToolCall, ToolParser, decode_call

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool = True) -> ParsedOutput:
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        position = 0
        while True:
            start = text.find(START, position)
            if start < 0:
                tail = text[position:]
                content.append(tail if final else tail[: len(tail) - pending_stop_prefix(tail, [START])])
                break
            content.append(text[position:start])
            end = text.find(END, start)
            if end < 0:  # an open block: a call only once the text has ended
                if final:
                    _add_block(text[start:], text[start + len(START) :], calls, content)
                break
            _add_block(text[start : end + len(END)], text[start + len(START) : end], calls, content)
            position = end + len(END)
        return ParsedOutput("".join(content), tuple(calls))


def _add_block(block: str, body: str, calls: list[ParsedToolCall], content: list[str]) -> None:
    """A block's call, or the block as content when it holds none."""
    call = decode_call(body)
    if call is not None:
        calls.append(call)
    else:
        content.append(block)
