"""The KV connector's messages and its scheduler half: plain data and a leaf of the scheduler.

The scheduler asks its connector how many of a request's next tokens it can supply
(`get_num_new_matched_tokens`, no side effects), tells it which blocks were allocated for them
(`update_state_after_alloc`), asks what to do with a finished request's blocks
(`request_finished`: it may hold them until a transfer is done), and builds each step's
`KVConnectorMetadata` from the scheduler output. The worker half reports back in each step's
`KVConnectorOutput`: transfers finished, loads failed, bytes and seconds spent.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagoda.scheduler.output import SchedulerOutput
    from pagoda.scheduler.request import Request


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass(frozen=True)
class KVConnectorMetadata:
    """What one step's worker half must move; each connector subclasses it with its jobs."""


@dataclass
class KVTransferStats:
    """Cumulative figures of a connector (the metrics read their differences)."""

    # Prompt tokens whose KV a load supplied instead of a recompute.
    hit_tokens: int = 0
    num_loads: int = 0
    load_bytes: int = 0
    # Sum over loads of the time from their start to their end on the copy stream.
    load_seconds: float = 0.0
    num_saves: int = 0
    save_bytes: int = 0
    # Loads and saves that failed (a failed load's request recomputes).
    num_failed_transfers: int = 0

    def add(self, other: KVTransferStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def copy(self) -> KVTransferStats:
        copied = KVTransferStats()
        copied.add(self)
        return copied


@dataclass(frozen=True)
class KVConnectorOutput:
    """The worker half's report after a step: ids of transfer jobs that completed or failed
    since the last report, and the bytes and time they took."""

    finished_saves: frozenset[str] = frozenset()
    finished_loads: frozenset[str] = frozenset()
    failed_saves: frozenset[str] = frozenset()
    failed_loads: frozenset[str] = frozenset()
    stats: KVTransferStats = field(default_factory=KVTransferStats)


@dataclass(frozen=True)
class TransferUpdate:
    """What a worker report means to the scheduler, by request id: loads done (the request may
    run from its loaded tokens), loads failed (it recomputes), and finished requests whose
    held blocks may now go back to the pool."""

    loaded: frozenset[str] = frozenset()
    failed: frozenset[str] = frozenset()
    released: frozenset[str] = frozenset()


class KVConnectorScheduler:
    """The scheduler half. The default supplies nothing and holds nothing."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens after the first `num_computed_tokens` (device prefix-cache hits) whose KV the
        connector can load, in whole blocks, leaving at least the last prompt token to compute.
        Loads are asynchronous: the request waits for them in WAITING_FOR_REMOTE_KVS."""
        return 0

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """Blocks were allocated for the request: `block_ids` (its whole list) from position
        `request.num_computed_tokens` on receive the `num_external_tokens` tokens to load."""

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """The request ended (`block_ids`: its prefix-cached leading blocks, maybe none); True
        holds those blocks until `TransferUpdate.released` names it (never with none)."""
        return False

    def finished_kv_transfer_params(self, request: Request) -> dict[str, Any] | None:
        """What the response of a request whose blocks `request_finished` just held tells a peer
        (disaggregated prefill: where and how to pull them); None: nothing."""
        return None

    def on_block_evicted(self, block_id: int, block_hash: bytes) -> None:
        """A cached block is about to be reused: its content is still there during this step."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata | None:
        """This step's jobs for the worker half; None when there is nothing to do or wait for."""
        return None

    def update_connector_output(self, output: KVConnectorOutput) -> TransferUpdate:
        return TransferUpdate()

    def request_load_abandoned(self, req_id: str) -> None:
        """The scheduler gave up waiting for the request's load (timeout): its late report is
        still expected, and releases the blocks the scheduler holds for it."""

    def has_pending_transfers(self) -> bool:
        """True while a job is queued or in flight (the engine keeps stepping to hear of it)."""
        return False

    @property
    def stats(self) -> KVTransferStats | None:
        return None

    def reset(self) -> None:
        """Forget stored KV (the weights changed)."""

    def check_idle(self) -> None:
        """Raise AssertionError unless no transfer is pending and every stored block is consistent."""
