"""The KV connector's worker half, called by the runner at the seed's points.

Per step: `bind_connector_metadata` (first thing in `execute_model`, before the block zeroer:
a save the step needs before its blocks are reused starts here), then, when nothing is
scheduled, `no_forward`; otherwise `pre_forward` (start the loads) and `post_forward` (wait
for the saves the step requires). `get_finished` reports transfers that completed or failed;
the runner hands it to the scheduler in the step's output.

Layer-wise connectors (`uses_layerwise_hooks`) also get `wait_for_layer_load` before and
`save_kv_layer` after each attention layer, through the forward context. Those calls are
Python between kernels, which a replayed full CUDA graph cannot make: the runner runs a step
that carries such a connector's metadata eagerly. Block-wise connectors (offload) move whole
blocks outside the forward, so graphs replay as usual.

The default connector does nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagoda.kv_transfer.interface import KVConnectorMetadata, KVConnectorOutput
from pagoda.outputs import ModelRunnerOutput
from pagoda.scheduler.output import SchedulerOutput

if TYPE_CHECKING:
    from pagoda.attention.metadata import AttentionMetadata
    from pagoda.kv_cache_interface import KVCacheConfig

# How long a step with nothing to compute waits for a transfer to finish before it reports
# (so an engine that only waits on loads does not spin).
IDLE_WAIT_S = 0.002


class KVConnector:
    uses_layerwise_hooks = False

    # ---- setup ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], kv_cache_config: KVCacheConfig) -> None:
        """Every layer's view of the cache by layer name; the config gives the groups and buffers."""

    # ---- per step ------------------------------------------------------------------------

    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        """This step's jobs, from the scheduler half."""

    def start_load_kv(self) -> None:
        """Start this step's loads (asynchronous: their requests do not run this step)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise only: block until `layer_name`'s KV for this step is in place."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata) -> None:
        """Layer-wise only: start saving what `layer_name` wrote this step."""

    def wait_for_save(self) -> None:
        """Block until the saves this step must finish before its blocks change are done."""

    def get_finished(self, wait_s: float = 0.0) -> KVConnectorOutput | None:
        """Transfers done or failed since the last call (None: nothing to report); with
        `wait_s`, wait up to that long for one when some are in flight."""
        return None

    def check_idle(self) -> None:
        """Raise AssertionError unless no transfer is in flight."""

    def shutdown(self) -> None:
        """Stop the connector's threads and release what it holds outside the device cache."""

    # ---- the seed's points in execute_model --------------------------------------------

    def can_skip_forward(self, scheduler_output: SchedulerOutput) -> bool:
        """True when every scheduled token's KV came from elsewhere and nothing is sampled."""
        return False

    def no_forward(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """A step without a forward: start its transfers and report the finished ones."""
        self.start_load_kv()
        output = ModelRunnerOutput.empty()
        output.kv_connector_output = self.get_finished(wait_s=IDLE_WAIT_S)
        return output

    def pre_forward(self, scheduler_output: SchedulerOutput) -> None:
        self.start_load_kv()

    def post_forward(self, scheduler_output: SchedulerOutput, hidden_states: torch.Tensor) -> None:
        self.wait_for_save()
