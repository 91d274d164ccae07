"""Reasoning parsers on canned model text: `<think>` blocks split from the answer, whole and
streamed character by character (the stream joins to the whole), tags split across pieces,
unclosed blocks, and reasoning followed by tool calls."""

from __future__ import annotations

import pytest
from test_tool_parsers import PARIS, stream

from pagoda.entrypoints.openai.message_parser import MessageParser, ParsedMessage
from pagoda.entrypoints.openai.reasoning import REASONING_PARSERS
from pagoda.entrypoints.openai.tool_parsers.hermes import HermesToolParser

CASES = [
    ("qwen3", "<think>\nThe user wants Paris.\n</think>\n\nParis.", "The user wants Paris.", "Paris."),
    ("qwen3", "Paris.", "", "Paris."),
    ("qwen3", "<think>\n\n</think>\n\nParis.", "", "Paris."),
    ("qwen3", "<think>still thinking", "still thinking", ""),
    ("qwen3", "<thi", "", "<thi"),
    ("qwen3", "a </think> b", "", "a </think> b"),
    ("deepseek_r1", "The user wants Paris.\n</think>\n\nParis.", "The user wants Paris.", "Paris."),
    ("deepseek_r1", "<think>Hmm.</think>Paris.", "Hmm.", "Paris."),
    ("deepseek_r1", "never answered", "never answered", ""),
    ("deepseek_r1", "x </thin", "x </thin", ""),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_whole_answer(name: str, text: str, reasoning: str, content: str) -> None:
    assert MessageParser(REASONING_PARSERS[name](), None).parse(text) == ParsedMessage(content, reasoning)


@pytest.mark.parametrize("size", [1, 4])
@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_streamed_answer_joins_to_the_whole(name: str, text: str, reasoning: str, content: str, size: int) -> None:
    whole = MessageParser(REASONING_PARSERS[name](), None).parse(text)
    assert stream(MessageParser(REASONING_PARSERS[name](), None), text, size) == whole


def test_reasoning_comes_before_the_content_in_a_stream() -> None:
    parser = MessageParser(REASONING_PARSERS["qwen3"](), None)
    assert parser.update("<think>Paris is the", final=False) == ParsedMessage("", "Paris is the")
    assert parser.update("<think>Paris is the capital</thi", final=False) == ParsedMessage("", " capital")
    assert parser.update("<think>Paris is the capital</think>\nParis", final=True) == ParsedMessage("Paris", "")


def test_reasoning_then_tool_calls() -> None:
    text = '<think>I need the weather.</think>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    parser = MessageParser(REASONING_PARSERS["qwen3"](), HermesToolParser())
    whole = parser.parse(text)
    assert whole == ParsedMessage("", "I need the weather.", (PARIS,))
    assert stream(MessageParser(REASONING_PARSERS["qwen3"](), HermesToolParser()), text, 1) == whole
