"""What every reasoning parser shares: a choice's text split into its reasoning and its
answer. As with tool-call parsers, `split(text, final=False)` returns only the settled part
of a growing text (a tag's start is held back until the next characters decide it), so a
stream joins to the answer given without streaming."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str
    content: str


class ReasoningParser(ABC):
    name: ClassVar[str]

    @abstractmethod
    def split(self, text: str, final: bool = True) -> ReasoningSplit:
        """The settled part of `text` as reasoning and content; with `final`, all of it."""
