"""The proposer that runs in the model runner, by method (n-gram drafts come from the scheduler)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagoda.config import SpeculativeConfig
from pagoda.spec_decode.draft_model import DraftModelProposer
from pagoda.spec_decode.eagle import EagleProposer

if TYPE_CHECKING:
    from pagoda.worker.gpu_model_runner import GPUModelRunner

# Methods whose drafts the runner proposes after each step (returned with its output).
RUNNER_METHODS = ("draft_model", "eagle", "eagle3")


def make_drafter(runner: GPUModelRunner, config: SpeculativeConfig | None) -> DraftModelProposer | None:
    """The runner's proposer for `config`, its model not loaded yet; None for n-grams or no speculation."""
    if config is None or config.method not in RUNNER_METHODS:
        return None
    assert config.draft_model_config is not None, "the engine config resolves the draft (see draft_config)"
    if config.method == "draft_model":
        return DraftModelProposer(runner, config.draft_model_config, config.num_speculative_tokens)
    return EagleProposer(runner, config.draft_model_config, config.num_speculative_tokens, config.method)
