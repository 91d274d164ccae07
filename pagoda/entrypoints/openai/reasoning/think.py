"""Reasoning between `<think>` and `</think>`, then the answer.

qwen3: Qwen3 writes `<think>` itself; an answer that does not open with it has no reasoning
(with `enable_thinking=False` its template closes an empty block in the prompt).
deepseek_r1: DeepSeek-R1's template opens the block in the prompt, so the output starts inside
the reasoning (a `<think>` the model writes anyway is dropped) and everything up to `</think>`
is reasoning: an output that never closes it is all reasoning, as the model never answered.
Either starts where its request's prompt says (base.py's OutputStart), when the prompt says."""

from __future__ import annotations

from pagoda.entrypoints.openai.reasoning.base import OutputStart, ReasoningParser, ReasoningSplit
from pagoda.entrypoints.openai.text_prefix import pending_stop_prefix

START = "<think>"
END = "</think>"


class ThinkReasoningParser(ReasoningParser):
    start_marker = START
    end_marker = END

    def split(self, text: str, final: bool = True) -> ReasoningSplit:
        if self.start is OutputStart.ANSWER:
            return ReasoningSplit("", text)
        stripped = text.lstrip()
        if not final and len(stripped) < len(START) and START.startswith(stripped):
            return ReasoningSplit("", "")  # the start tag may still be coming
        if stripped.startswith(START):
            body = stripped[len(START) :]
        elif self.start is OutputStart.REASONING:
            body = text
        else:
            return ReasoningSplit("", text)
        end = body.find(END)
        if end >= 0:
            return ReasoningSplit(body[:end], body[end + len(END) :])
        # No end yet: all reasoning (an output that never closes the block never answered).
        return ReasoningSplit(body if final else body[: len(body) - pending_stop_prefix(body, [END])], "")


class Qwen3ReasoningParser(ThinkReasoningParser):
    name = "qwen3"
    default_start = OutputStart.MAY_REASON


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    name = "deepseek_r1"
    default_start = OutputStart.REASONING
