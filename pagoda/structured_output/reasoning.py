"""`ReasoningGate`: where a reasoning model's output leaves its free reasoning for the grammar.

A model that thinks before it answers must not have its thinking shaped by the answer's JSON
schema: the grammar applies only after the reasoning's end marker (vLLM's rule). The gate reads
only the sampled token ids, so the engine stays generic: the server tells it the markers'
tokens (from its reasoning parser and the tokenizer), an offline user sets them directly.

Phases of an output, decided by its tokens alone (so a rollback or a replayed history after
preemption lands in the same phase):

- OPENING: nothing sampled yet, and the model may open its reasoning itself (a start marker
  is set): the first token is one the grammar allows or the marker's first;
- FORCING: the first token opened the start marker and the marker has more tokens: they follow;
- REASONING: free, until the end marker has been sampled;
- GRAMMAR: the grammar rules every later token.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from pagoda.sampling_params import StructuredOutputsParams


class Phase(enum.Enum):
    OPENING = "opening"
    FORCING = "forcing"
    REASONING = "reasoning"
    GRAMMAR = "grammar"


@dataclass(frozen=True)
class ReasoningGate:
    end: tuple[int, ...]
    start: tuple[int, ...] | None = None

    @classmethod
    def of(cls, params: StructuredOutputsParams | None) -> ReasoningGate | None:
        """The request's gate; None when the constraint applies from the first token."""
        if params is None or params.reasoning_end_token_ids is None:
            return None
        return cls(params.reasoning_end_token_ids, params.reasoning_start_token_ids)

    def phase(self, num_tokens: int) -> Phase:
        """The phase after `num_tokens` tokens that did not enter the grammar (the start
        marker, when set, is their beginning: anything else would have entered the grammar)."""
        if self.start is None:
            return Phase.REASONING
        if num_tokens == 0:
            return Phase.OPENING
        return Phase.FORCING if num_tokens < len(self.start) else Phase.REASONING

    def forced_token(self, num_tokens: int) -> int:
        """The start marker's next token, in the FORCING phase."""
        assert self.start is not None
        return self.start[num_tokens]

    def ends_reasoning(self, tokens: Sequence[int]) -> bool:
        """Whether the reasoning `tokens` (all of the output so far) end with the end marker,
        written wholly after the start marker."""
        opened = len(self.start) if self.start is not None else 0
        size = len(self.end)
        return len(tokens) - opened >= size and tuple(tokens[-size:]) == self.end
