"""Reasoning parsers by name (`--reasoning-parser`; none unless the flag names one). The CLI
imports this package to list them: nothing here may need the server's packages (fastapi);
the constraint gate (`gate.py`) is imported by the server alone."""

from __future__ import annotations

from pagoda.entrypoints.openai.reasoning.base import OutputStart, ReasoningParser, ReasoningSplit
from pagoda.entrypoints.openai.reasoning.think import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}

__all__ = ["REASONING_PARSERS", "OutputStart", "ReasoningParser", "ReasoningSplit"]
