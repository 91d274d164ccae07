"""Reasoning parsers by name (`--reasoning-parser`; none unless the flag names one)."""

from __future__ import annotations

from pagoda.entrypoints.openai.reasoning.base import OutputStart, ReasoningParser, ReasoningSplit
from pagoda.entrypoints.openai.reasoning.gate import ReasoningMarkers, output_start
from pagoda.entrypoints.openai.reasoning.think import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}

__all__ = ["REASONING_PARSERS", "OutputStart", "ReasoningMarkers", "ReasoningParser", "ReasoningSplit", "output_start"]
