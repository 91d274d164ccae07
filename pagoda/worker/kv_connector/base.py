"""The KV connector seam: where a disaggregated-prefill or KV-offload connector plugs in.

The default connector does nothing; the runner calls it at the seed's points so that a real
one needs no change to the runner.
"""

from __future__ import annotations

import torch

from pagoda.outputs import ModelRunnerOutput
from pagoda.scheduler.output import SchedulerOutput


class KVConnector:
    def can_skip_forward(self, scheduler_output: SchedulerOutput) -> bool:
        """True when every scheduled token's KV came from elsewhere and nothing is sampled."""
        return False

    def no_forward(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput.empty()

    def pre_forward(self, scheduler_output: SchedulerOutput) -> None:
        """Start loading remote KV for the scheduled requests."""

    def post_forward(self, scheduler_output: SchedulerOutput, hidden_states: torch.Tensor) -> None:
        """Start saving the KV this step computed."""
