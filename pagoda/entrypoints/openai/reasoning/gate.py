"""Constraints after the reasoning: a request with a constraint (response_format, guided_*,
a forced tool choice) on a server with a reasoning parser lets the model reason freely and
has the grammar shape only the answer after it.

The engine's gate (structured_output/reasoning.py) reads token ids; this module gives it the
markers' ids, from the parser's marker text and the tokenizer, and decides per request where
the output begins (for the parser too), from the end of its prompt: a prompt that ends with the end marker closed
the reasoning (the constraint applies from the first token), one that ends with the start
marker opened it (free until the end marker), and otherwise the parser's default holds (Qwen3
opens the block itself or answers at once; DeepSeek-R1 starts inside it)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from pagoda.entrypoints.openai.reasoning.base import OutputStart, ReasoningParser
from pagoda.entrypoints.openai.structured import Constraint

logger = logging.getLogger(__name__)

# Prompt tokens read for a marker at its end (the marker, trailing whitespace, a newline).
TAIL_TOKENS = 16


def output_start(parser: type[ReasoningParser], prompt: list[int], tokenizer: PreTrainedTokenizerBase) -> OutputStart:
    """Where the output of `prompt` begins (see the module's rule)."""
    tail = tokenizer.decode(prompt[-TAIL_TOKENS:], skip_special_tokens=False).rstrip()
    if tail.endswith(parser.end_marker):
        return OutputStart.ANSWER
    if tail.endswith(parser.start_marker):
        return OutputStart.REASONING
    return parser.default_start


@dataclass(frozen=True)
class ReasoningMarkers:
    """A reasoning parser's markers as token ids: one each, as a reasoning model has them."""

    start_id: int
    end_id: int

    @classmethod
    def of(cls, parser: type[ReasoningParser], tokenizer: PreTrainedTokenizerBase) -> ReasoningMarkers | None:
        """The markers' ids; None (constraints apply from the first token) where this model
        spells a marker in several tokens: it was not trained to reason with them, and a gate
        would only let it wander into a reasoning it never closes."""
        start, end = (
            tokenizer.encode(text, add_special_tokens=False) for text in (parser.start_marker, parser.end_marker)
        )
        if len(start) == len(end) == 1:
            return cls(start[0], end[0])
        logger.info(
            "reasoning parser %s: %r and %r are not one token each in this model's vocabulary, so "
            "constraints apply from the first token (the reasoning is still split from the answer)",
            parser.name,
            parser.start_marker,
            parser.end_marker,
        )
        return None

    def gate(self, constraint: Constraint, start: OutputStart) -> Constraint:
        """`constraint`, applied only after the reasoning of an output that begins at `start`."""
        if start is OutputStart.ANSWER:
            return constraint
        params = dataclasses.replace(
            constraint.params,
            reasoning_end_token_ids=(self.end_id,),
            reasoning_start_token_ids=(self.start_id,) if start is OutputStart.MAY_REASON else None,
        )
        return Constraint(params, constraint.field)
