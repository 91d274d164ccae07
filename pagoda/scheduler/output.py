"""`SchedulerOutput`: the per-step diff the scheduler hands to every worker.

Plain data only (no references to scheduler objects), so it can be serialized to another
process unchanged. New requests travel in full; running ones only as what changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.kv_transfer.interface import KVConnectorMetadata
from pagoda.lora.request import LoRARequest
from pagoda.multimodal.inputs import MultiModalFeatureSpec
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams

# Block ids per KV-cache group; one group for now.
BlockIds = tuple[list[int], ...]


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: BlockIds
    num_computed_tokens: int
    # A pooling request's settings (its sampling_params are then a placeholder that samples nothing).
    pooling_params: PoolingParams | None = None
    # The adapter the request runs with (None: the base model).
    lora_request: LoRARequest | None = None
    # The prompt's images (their pixels and hashes); the runner keeps them until the request ends.
    mm_features: tuple[MultiModalFeatureSpec, ...] = ()


@dataclass
class CachedRequestData:
    """Requests the runner already knows, as parallel lists (one entry per request).

    A request resumed after preemption *replaces* its block ids and carries its whole token
    history (prompt + outputs), since the runner dropped it from the batch when preempted.
    For the others `new_block_ids` holds only blocks appended this step (or None).
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    resumed_token_ids: list[list[int] | None] = field(default_factory=list)
    new_block_ids: list[BlockIds | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # Pipeline parallelism only (else empty): per request, the tokens sampled since it last ran,
    # which stages other than the last (they do not sample) append to their token history.
    new_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> number of tokens computed for it this step.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # req_id -> draft tokens to verify (empty until speculative decoding lands).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Requests scheduled while their verify step is in flight: their tokens are laid out as if it
    # accepted every draft, and the runner moves them back by its rejected count on the device.
    behind_verify: set[str] = field(default_factory=set)
    # Requests that ended since the last step (finished, aborted, stopped): drop their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # Block ids that went back to the pool since the last step (for the KV block zeroer).
    freed_block_ids: list[int] = field(default_factory=list)
    # Requests preempted since the last step: the runner drops them from the batch but may
    # keep nothing else, since they come back with their full history.
    preempted_req_ids: set[str] = field(default_factory=set)
    # The KV connector's jobs for this step (None: no connector, or nothing to move or wait for).
    kv_connector_metadata: KVConnectorMetadata | None = None
    # req_id -> indices (into its mm_features) of the images whose encoder runs this step.
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
