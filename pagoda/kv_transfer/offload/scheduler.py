"""`OffloadingScheduler`: the scheduler half of CPU offload.

Saves: a cached block the device pool evicts is copied to the host before the step that
reuses it writes anything (`BlockCopyJob.before_forward`); with `save_on_finish`, a finished
request's cached blocks are copied too, its blocks held until the copy is done. A block is
readable on the host only once its save is reported done.

Loads: a request admitted with host hits past its device hits gets fresh device blocks for
them and waits in WAITING_FOR_REMOTE_KVS while they are copied in on the worker's copy stream;
the host slots are pinned until the load is reported. A failed load forgets its host blocks
and the request recomputes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagoda.kv_transfer.interface import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVTransferStats,
    TransferUpdate,
)
from pagoda.kv_transfer.offload.host_index import HostBlockIndex
from pagoda.scheduler.output import SchedulerOutput
from pagoda.scheduler.request import Request

# The device prefix cache's key of a request's block i (hashes, index) -> key.
BlockKeyFn = Callable[[Sequence[bytes], int], bytes]


@dataclass(frozen=True)
class BlockCopyJob:
    """Copy device blocks `block_ids[i]` to or from host slots `slots[i]`."""

    job_id: str
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]
    # A save the step's forward (and the block zeroer) must wait for: its blocks are reused now.
    before_forward: bool = False


@dataclass(frozen=True)
class OffloadMetadata(KVConnectorMetadata):
    saves: tuple[BlockCopyJob, ...] = ()
    loads: tuple[BlockCopyJob, ...] = ()


@dataclass(frozen=True)
class _Job:
    req_id: str | None
    keys: tuple[bytes, ...]
    slots: tuple[int, ...]


class OffloadingScheduler(KVConnectorScheduler):
    def __init__(self, num_host_blocks: int, block_size: int, block_key: BlockKeyFn, save_on_finish: bool) -> None:
        self.index = HostBlockIndex(num_host_blocks)
        self.block_size = block_size
        self._block_key = block_key
        self.save_on_finish = save_on_finish
        self._ids = itertools.count()
        self._loads: dict[str, _Job] = {}
        self._saves: dict[str, _Job] = {}
        self._new_loads: list[BlockCopyJob] = []
        self._new_saves: list[BlockCopyJob] = []
        self._evicted: list[tuple[int, bytes]] = []
        # Requests whose load the scheduler stopped waiting for: their tokens are recomputed.
        self._abandoned: set[str] = set()
        self._stats = KVTransferStats()

    # ---- lookups and loads -----------------------------------------------------------------

    def _keys(self, request: Request, first: int, last: int) -> list[bytes]:
        return [self._block_key(request.block_hashes, i) for i in range(first, last)]

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        first = num_computed_tokens // self.block_size
        last = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        if last <= first:
            return 0
        return self.index.num_hits(self._keys(request, first, last)) * self.block_size

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        if not num_external_tokens:
            return
        first = request.num_computed_tokens // self.block_size
        last = first + num_external_tokens // self.block_size
        keys = tuple(self._keys(request, first, last))
        slots = tuple(self.index.pin(keys))
        job_id = f"load-{next(self._ids)}"
        self._loads[job_id] = _Job(request.request_id, keys, slots)
        self._new_loads.append(BlockCopyJob(job_id, tuple(block_ids[first:last]), slots))

    # ---- saves -----------------------------------------------------------------------------

    def on_block_evicted(self, block_id: int, block_hash: bytes) -> None:
        self._evicted.append((block_id, block_hash))

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """With save_on_finish: copy the request's cached blocks (`block_ids`, the leading blocks
        registered in the device prefix cache) the host lacks, holding them until copied."""
        if not self.save_on_finish:
            return False
        num_cached = min(len(block_ids), len(request.block_hashes))
        pairs = [
            (block_id, key)
            for block_id, key in zip(block_ids[:num_cached], self._keys(request, 0, num_cached), strict=True)
            if not self.index.is_stored_or_storing(key)
        ]
        job = self._reserve_save(pairs, request.request_id, before_forward=False)
        if job is None:
            return False
        self._new_saves.append(job)
        return True

    def _reserve_save(
        self, pairs: list[tuple[int, bytes]], req_id: str | None, before_forward: bool
    ) -> BlockCopyJob | None:
        block_ids, keys, slots = [], [], []
        for block_id, key in pairs:
            if self.index.is_stored_or_storing(key):
                continue
            slot = self.index.reserve(key)
            if slot is None:
                break  # every host slot is pinned or being written
            block_ids.append(block_id)
            keys.append(key)
            slots.append(slot)
        if not slots:
            return None
        job_id = f"save-{next(self._ids)}"
        self._saves[job_id] = _Job(req_id, tuple(keys), tuple(slots))
        return BlockCopyJob(job_id, tuple(block_ids), tuple(slots), before_forward)

    # ---- per step --------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadMetadata | None:
        """The step's jobs. Evicted blocks are saved before the forward; loads pinned their host
        slots already, so no save reserved here can take them. Empty metadata still travels
        while jobs are in flight, so the worker reports them."""
        evicted, self._evicted = self._evicted, []
        saves = self._new_saves
        job = self._reserve_save(evicted, None, before_forward=True)
        if job is not None:
            saves.append(job)
        loads = self._new_loads
        self._new_saves, self._new_loads = [], []
        if not (saves or loads or self._saves or self._loads):
            return None
        return OffloadMetadata(tuple(saves), tuple(loads))

    def update_connector_output(self, output: KVConnectorOutput) -> TransferUpdate:
        released = set()
        for job_id in output.finished_saves | output.failed_saves:
            job = self._saves.pop(job_id)
            if job_id in output.failed_saves:
                self.index.discard(job.keys)
            else:
                self.index.commit(job.keys)
            if job.req_id is not None:
                released.add(job.req_id)
        loaded, failed = set(), set()
        for job_id in output.finished_loads | output.failed_loads:
            job = self._loads.pop(job_id)
            self.index.unpin(job.slots)
            assert job.req_id is not None
            if job_id in output.failed_loads:
                self.index.discard(job.keys)  # their host copies are suspect
                failed.add(job.req_id)
            else:
                loaded.add(job.req_id)
                if job.req_id not in self._abandoned:
                    self._stats.hit_tokens += len(job.keys) * self.block_size
            self._abandoned.discard(job.req_id)
        self._stats.add(output.stats)
        return TransferUpdate(frozenset(loaded), frozenset(failed), frozenset(released))

    def request_load_abandoned(self, req_id: str) -> None:
        self._abandoned.add(req_id)

    def has_pending_transfers(self) -> bool:
        return bool(self._loads or self._saves or self._new_loads or self._new_saves or self._evicted)

    @property
    def stats(self) -> KVTransferStats:
        return self._stats

    def reset(self) -> None:
        self.index.reset()

    def check_idle(self) -> None:
        pending = {"loads": sorted(self._loads), "saves": sorted(self._saves)}
        left = {kind: ids[:8] for kind, ids in pending.items() if ids}
        if left or self._new_loads or self._new_saves or self._evicted:
            raise AssertionError(f"KV offload not idle: jobs in flight {left}")
        self.index.check_idle()
