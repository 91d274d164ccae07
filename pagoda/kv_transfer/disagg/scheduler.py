"""The scheduler halves of disaggregated prefill: `ProducerScheduler` and `ConsumerScheduler`.

Producer: a request sent with `{"do_remote_decode": true}` that ends normally (stopped or length
capped, not aborted) has its full, prefix-cached blocks held (`request_finished` returns True)
and exported: the worker half learns the export in the next step's metadata and answers pulls
for it. Its answer carries `RemotePrefill.to_params()`. The worker reports the export done when
the consumer acknowledges its pull (`finished_saves`) or when it expired unpulled
(`failed_saves`); either releases the blocks.

Consumer: a request with a producer's params is offered the leading blocks whose hashes match
its own, past its device prefix-cache hits and short of its last prompt token; its worker pulls
them while the request waits in WAITING_FOR_REMOTE_KVS. It is offered once: after a failed or
abandoned pull (or a preemption) it recomputes.
"""

from __future__ import annotations

import itertools
import logging
import secrets
from dataclasses import dataclass

from pagoda.kv_transfer.disagg.params import RemoteDecode, RemotePrefill, parse_kv_transfer_params
from pagoda.kv_transfer.interface import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVTransferStats,
    TransferUpdate,
)
from pagoda.outputs import RequestStatus
from pagoda.scheduler.output import SchedulerOutput
from pagoda.scheduler.request import Request

logger = logging.getLogger(__name__)

# Statuses after which a producer keeps the blocks for a consumer (not aborted, not failed).
_HOLDING_STATUSES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


@dataclass(frozen=True)
class BlockExport:
    """Producer: serve pulls of `block_ids` for `request_id` to whoever presents `token`."""

    request_id: str
    token: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class ExportMetadata(KVConnectorMetadata):
    exports: tuple[BlockExport, ...] = ()


@dataclass(frozen=True)
class BlockPull:
    """Consumer: copy the producer's `remote_block_ids` into the local `block_ids`."""

    job_id: str
    remote_address: str
    remote_request_id: str
    remote_token: str
    remote_block_ids: tuple[int, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class PullMetadata(KVConnectorMetadata):
    pulls: tuple[BlockPull, ...] = ()


class ProducerScheduler(KVConnectorScheduler):
    def __init__(self, address: str, block_size: int) -> None:
        self.address = address
        self.block_size = block_size
        self._new: list[BlockExport] = []
        # Held request ids (the export ids) until the worker reports them done.
        self._held: set[str] = set()
        self._params: dict[str, dict] = {}
        self._stats = KVTransferStats()

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        wanted = parse_kv_transfer_params(request.sampling_params.kv_transfer_params)
        num_blocks = min(len(block_ids), len(request.block_hashes))
        if not isinstance(wanted, RemoteDecode) or request.status not in _HOLDING_STATUSES or not num_blocks:
            return False
        export = BlockExport(request.request_id, secrets.token_hex(16), tuple(block_ids[:num_blocks]))
        self._new.append(export)
        self._held.add(export.request_id)
        self._params[request.request_id] = RemotePrefill(
            remote_address=self.address,
            remote_request_id=export.request_id,
            remote_token=export.token,
            remote_block_ids=export.block_ids,
            remote_block_hashes=tuple(request.block_hashes[:num_blocks]),
            block_size=self.block_size,
        ).to_params()
        return True

    def finished_kv_transfer_params(self, request: Request) -> dict | None:
        return self._params.pop(request.request_id, None)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ExportMetadata | None:
        """New exports; empty metadata while any is held, so the worker reports their end."""
        new, self._new = self._new, []
        if not new and not self._held:
            return None
        return ExportMetadata(tuple(new))

    def update_connector_output(self, output: KVConnectorOutput) -> TransferUpdate:
        released = output.finished_saves | output.failed_saves
        self._held -= released
        self._stats.add(output.stats)
        return TransferUpdate(released=frozenset(released))

    def has_pending_transfers(self) -> bool:
        return bool(self._held or self._new)

    @property
    def stats(self) -> KVTransferStats:
        return self._stats

    def check_idle(self) -> None:
        if self._held or self._new or self._params:
            raise AssertionError(f"KV producer not idle: exports held {sorted(self._held)[:8]}")


class ConsumerScheduler(KVConnectorScheduler):
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._ids = itertools.count()
        self._new: list[BlockPull] = []
        # Pull job id -> (request id, tokens it loads).
        self._pulls: dict[str, tuple[str, int]] = {}
        # Requests offered a pull already: never again (they recompute instead).
        self._offered: set[str] = set()
        self._abandoned: set[str] = set()
        self._stats = KVTransferStats()

    def _remote(self, request: Request) -> RemotePrefill | None:
        remote = parse_kv_transfer_params(request.sampling_params.kv_transfer_params)
        if not isinstance(remote, RemotePrefill) or request.request_id in self._offered:
            return None
        if remote.block_size != self.block_size:
            logger.warning(
                "request %r: the producer's block_size %d is not this engine's %d; recomputing its prompt",
                request.request_id,
                remote.block_size,
                self.block_size,
            )
            return None
        return remote

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        remote = self._remote(request)
        if remote is None:
            return 0
        matched = 0
        for mine, theirs in zip(request.block_hashes, remote.remote_block_hashes, strict=False):
            if mine != theirs:
                break
            matched += 1
        last = min(matched, (request.num_tokens - 1) // self.block_size)
        first = num_computed_tokens // self.block_size
        return max(0, last - first) * self.block_size

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        remote = self._remote(request)
        self._offered.add(request.request_id)
        if remote is None or not num_external_tokens:
            return
        first = request.num_computed_tokens // self.block_size
        last = first + num_external_tokens // self.block_size
        job_id = f"pull-{next(self._ids)}"
        self._pulls[job_id] = (request.request_id, num_external_tokens)
        self._new.append(
            BlockPull(
                job_id=job_id,
                remote_address=remote.remote_address,
                remote_request_id=remote.remote_request_id,
                remote_token=remote.remote_token,
                remote_block_ids=remote.remote_block_ids[first:last],
                block_ids=tuple(block_ids[first:last]),
            )
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        self._offered.discard(request.request_id)
        return False

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PullMetadata | None:
        new, self._new = self._new, []
        if not new and not self._pulls:
            return None
        return PullMetadata(tuple(new))

    def update_connector_output(self, output: KVConnectorOutput) -> TransferUpdate:
        loaded, failed = set(), set()
        for job_id in output.finished_loads | output.failed_loads:
            req_id, num_tokens = self._pulls.pop(job_id)
            if job_id in output.failed_loads:
                failed.add(req_id)
            else:
                loaded.add(req_id)
                if req_id not in self._abandoned:
                    self._stats.hit_tokens += num_tokens
            self._abandoned.discard(req_id)
        self._stats.add(output.stats)
        return TransferUpdate(loaded=frozenset(loaded), failed=frozenset(failed))

    def request_load_abandoned(self, req_id: str) -> None:
        self._abandoned.add(req_id)

    def has_pending_transfers(self) -> bool:
        return bool(self._pulls or self._new)

    @property
    def stats(self) -> KVTransferStats:
        return self._stats

    def check_idle(self) -> None:
        if self._pulls or self._new or self._offered:
            raise AssertionError(
                f"KV consumer not idle: pulls in flight {sorted(self._pulls)[:8]}, offered {sorted(self._offered)[:8]}"
            )
