"""Reasoning parsers on canned model text: `<think>` blocks split from the answer, whole and
streamed character by character (the stream joins to the whole), tags split across pieces,
unclosed blocks, and reasoning followed by tool calls; where a prompt's end says the output
begins (opened, closed, or the parser's default), which the parser follows, and the markers'
token ids the constraint's reasoning gate gets."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")  # the constraint gate and the structured fields are the server's

from structured_output.byte_tokenizer import byte_tokenizer
from test_tool_parsers import PARIS, stream

from pagoda.entrypoints.openai.message_parser import MessageParser, ParsedMessage
from pagoda.entrypoints.openai.reasoning import REASONING_PARSERS, OutputStart
from pagoda.entrypoints.openai.reasoning.base import count_reasoning_tokens
from pagoda.entrypoints.openai.reasoning.gate import ReasoningMarkers, output_start
from pagoda.entrypoints.openai.structured import json_object
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


# ---- where the output begins, and the constraint's gate ------------------------------------

THINK_TOKENIZER = byte_tokenizer(("<think>", "</think>"))  # <think> is id 1, </think> id 2
QWEN3, DEEPSEEK_R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]


@pytest.mark.parametrize(
    ("parser", "prompt_end", "start"),
    [
        (QWEN3, "assistant:", OutputStart.MAY_REASON),
        (DEEPSEEK_R1, "assistant:", OutputStart.REASONING),
        (QWEN3, "assistant: <think>\n", OutputStart.REASONING),  # the template opened it
        (DEEPSEEK_R1, "assistant: <think>\n\n</think>\n\n", OutputStart.ANSWER),  # closed it
        (QWEN3, "<think>a</think> then <think>", OutputStart.REASONING),
        (QWEN3, "</think> earlier. assistant:", OutputStart.MAY_REASON),  # only the prompt's end counts
    ],
)
def test_the_prompts_end_says_where_the_output_begins(parser, prompt_end: str, start: OutputStart) -> None:
    prompt = THINK_TOKENIZER.encode("user: hi\n" + prompt_end)
    assert output_start(parser, prompt, THINK_TOKENIZER) is start


def test_markers_are_token_ids_only_where_the_model_has_a_token_for_each() -> None:
    markers = ReasoningMarkers.of(QWEN3, THINK_TOKENIZER)
    assert markers == ReasoningMarkers(start_id=1, end_id=2)
    assert ReasoningMarkers.of(QWEN3, byte_tokenizer()) is None  # "<think>" is 7 byte tokens there
    constraint = json_object("response_format")
    assert markers.gate(constraint, OutputStart.ANSWER) == constraint
    opened = markers.gate(constraint, OutputStart.REASONING)
    assert opened.field == "response_format" and opened.params.json_object
    assert (opened.params.reasoning_end_token_ids, opened.params.reasoning_start_token_ids) == ((2,), None)
    may = markers.gate(constraint, OutputStart.MAY_REASON).params
    assert (may.reasoning_end_token_ids, may.reasoning_start_token_ids) == ((2,), (1,))


@pytest.mark.parametrize(
    ("name", "start", "text", "reasoning", "content"),
    [
        ("qwen3", OutputStart.ANSWER, "<think>x</think>Paris.", "", "<think>x</think>Paris."),
        ("deepseek_r1", OutputStart.ANSWER, "Paris.", "", "Paris."),
        ("qwen3", OutputStart.REASONING, "Hmm.</think>Paris.", "Hmm.", "Paris."),
        ("deepseek_r1", OutputStart.MAY_REASON, "Paris.", "", "Paris."),
    ],
)
def test_the_parser_follows_the_prompts_start(
    name: str, start: OutputStart, text: str, reasoning: str, content: str
) -> None:
    parser = REASONING_PARSERS[name]
    assert MessageParser(parser(start), None).parse(text) == ParsedMessage(content, reasoning)
    assert stream(MessageParser(parser(start), None), text, 3) == ParsedMessage(content, reasoning)


@pytest.mark.parametrize(
    ("pieces", "expected"),
    [
        (["Let", " me", " see", "</think>", "Paris", "."], 4),  # through the marker
        (["<think>", "hm", "</think>", "\n\n", "Paris"], 3),  # the model opened it
        (["Let", " me", " see"], 3),  # cut off while reasoning: all of it
        (["</", "think", ">", "Paris"], 3),  # a marker of several tokens
    ],
)
def test_reasoning_tokens_are_those_through_the_end_marker(pieces: list[str], expected: int) -> None:
    decodes = []

    def decode(ids: list[int]) -> str:
        decodes.append(len(ids))
        return "".join(pieces[i] for i in ids)

    ids = list(range(len(pieces)))
    assert count_reasoning_tokens("".join(pieces), ids, "</think>", decode) == expected
    assert len(decodes) <= len(pieces).bit_length()
