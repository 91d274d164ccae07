"""What every reasoning parser shares: a choice's text split into its reasoning and its
answer. As with tool-call parsers, `split(text, final=False)` returns only the settled part
of a growing text (a tag's start is held back until the next characters decide it), so a
stream joins to the answer given without streaming.

Where an output begins depends on the prompt as much as on the model: a template may open the
reasoning block in the prompt (DeepSeek-R1's), close an empty one there (Qwen3's with
enable_thinking false), or leave the model to open it. `OutputStart` says which, per request
(gate.py reads it off the prompt), and the parser and the constraint's reasoning gate both
follow it, so the answer they split and the answer the grammar shapes are one."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar


class OutputStart(enum.Enum):
    REASONING = "reasoning"  # inside the reasoning: it ends at the end marker
    MAY_REASON = "may_reason"  # the model opens the reasoning with the start marker, or answers at once
    ANSWER = "answer"  # the prompt closed the reasoning: all of the output is the answer


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str
    content: str


class ReasoningParser(ABC):
    name: ClassVar[str]
    # The markers around the reasoning, as text.
    start_marker: ClassVar[str]
    end_marker: ClassVar[str]
    # Where an output begins when its prompt neither opened nor closed the reasoning.
    default_start: ClassVar[OutputStart]

    def __init__(self, start: OutputStart | None = None) -> None:
        self.start = start or self.default_start

    @abstractmethod
    def split(self, text: str, final: bool = True) -> ReasoningSplit:
        """The settled part of `text` as reasoning and content; with `final`, all of it."""


def count_reasoning_tokens(text: str, token_ids: list[int], end_marker: str, decode: Callable[[list[int]], str]) -> int:
    """Output tokens spent reasoning (a usage figure: `reasoning_tokens`) for an output that
    reasoned: those up to and with the end marker, or all of them when it never got there.
    `decode` turns ids into text as the output's text was made; the prefix whose text first
    reaches past the marker is found by bisection, so a long output costs a few decodes."""
    end = text.find(end_marker)
    if end < 0:
        return len(token_ids)
    boundary = end + len(end_marker)
    low, high = 0, len(token_ids)
    while low < high:
        middle = (low + high) // 2
        if len(decode(token_ids[:middle])) >= boundary:
            high = middle
        else:
            low = middle + 1
    return low
