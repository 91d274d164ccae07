"""`RemoteKV`: the scheduler's side of a KV connector's transfers.

A request admitted with tokens the connector can supply gets blocks for them, and for its
first prefill chunk after them (so it runs as soon as its load is done, instead of waiting
for room that other loads took meanwhile), and waits in WAITING_FOR_REMOTE_KVS (out of the waiting queue, in no batch) until the worker reports its
load: done, it goes back to the front of the waiting queue with those tokens computed (its
blocks registered in the prefix cache); failed or past `kv_load_timeout_s`, it recomputes
(the connector is not asked for it again). Blocks a transfer still uses when their request
ends (aborted while loading, timed out, or held by the connector for a save) are detached
from it and kept here until the transfer is reported; the pool is whole only after that.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pagoda.kv_transfer.interface import KVConnectorOutput, KVConnectorScheduler
from pagoda.outputs import RequestStatus
from pagoda.scheduler.kv_cache_manager import GroupBlocks, KVCacheManager
from pagoda.scheduler.request import Request

logger = logging.getLogger(__name__)


def _load_hold(req_id: str) -> str:
    return f"{req_id}:load"


class RemoteKV:
    def __init__(
        self, connector: KVConnectorScheduler, kv: KVCacheManager, timeout_s: float, chunk_tokens: int
    ) -> None:
        """`chunk_tokens`: the most tokens one prefill step computes (the step budget)."""
        self.connector = connector
        self.kv = kv
        self.timeout_s = timeout_s
        self.chunk_tokens = chunk_tokens
        kv.block_pool.on_evict = connector.on_block_evicted
        self.loading: dict[str, Request] = {}
        # Per loading request: (status to resume with, tokens being loaded, deadline).
        self._loads: dict[str, tuple[RequestStatus, int, float]] = {}
        # Blocks kept for a transfer after their request let go of them, by hold id.
        self.held: dict[str, GroupBlocks] = {}
        # Requests whose load failed: they recompute.
        self._recompute: set[str] = set()

    def start_load(self, request: Request, hit_blocks: GroupBlocks, num_hit_tokens: int) -> bool | None:
        """Admit a waiting request to load its tokens past the device hits: True when it now
        waits for them, False when the pool has no room (admit no more), None when the
        connector has none of them."""
        if request.request_id in self._recompute:
            return None
        num_external = self.connector.get_num_new_matched_tokens(request, num_hit_tokens)
        if not num_external:
            return None
        num_after = min(request.num_tokens - num_hit_tokens - num_external, self.chunk_tokens)
        if self.kv.allocate_slots(request, num_external + num_after, hit_blocks) is None:
            return False
        request.num_computed_tokens = num_hit_tokens
        self._loads[request.request_id] = (request.status, num_external, time.monotonic() + self.timeout_s)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[request.request_id] = request
        self.connector.update_state_after_alloc(request, self.kv.get_block_ids(request)[0], num_external)
        return True

    def update(self, output: KVConnectorOutput) -> list[Request]:
        """Apply a worker report; the requests to put back at the front of the waiting queue."""
        update = self.connector.update_connector_output(output)
        for req_id in update.released:
            self.kv.free_detached(self.held.pop(req_id))
        resumed = []
        for req_id in update.loaded | update.failed:
            hold = self.held.pop(_load_hold(req_id), None)
            if hold is not None:  # its request ended or gave up waiting
                self.kv.free_detached(hold)
                continue
            request = self.loading.pop(req_id)
            status, num_loaded, _ = self._loads.pop(req_id)
            request.status = status
            if req_id in update.failed:
                logger.warning("request %r: its KV load failed; recomputing", req_id)
                self.kv.free(request)
                request.num_computed_tokens = 0
                self._recompute.add(req_id)
            else:
                request.num_computed_tokens += num_loaded
                self.kv.cache_blocks(request, request.num_computed_tokens)
            resumed.append(request)
        return resumed

    def expire(self, now: float | None = None) -> list[Request]:
        """Loading requests past their deadline give up and recompute; returns them."""
        now = time.monotonic() if now is None else now
        expired = [self.loading[req_id] for req_id, (_, _, deadline) in self._loads.items() if deadline <= now]
        for request in expired:
            logger.warning(
                "request %r: its KV did not load within %.1f s; recomputing", request.request_id, self.timeout_s
            )
            self.abandon(request)
            self._recompute.add(request.request_id)
        return expired

    def abandon(self, request: Request) -> None:
        """Stop waiting for a loading request's KV; its blocks stay held until the load reports."""
        req_id = request.request_id
        del self.loading[req_id]
        status, _, _ = self._loads.pop(req_id)
        request.status = status
        request.num_computed_tokens = 0
        self.held[_load_hold(req_id)] = self.kv.detach(request)
        self.connector.request_load_abandoned(req_id)

    def release(self, request: Request) -> dict[str, Any] | None:
        """Free a finished request's blocks, unless the connector holds them for a transfer;
        returns the connector's `kv_transfer_params` for the request's response, if any."""
        self._recompute.discard(request.request_id)
        block_ids = self.kv.get_block_ids(request)[0][: self.kv.num_cached_blocks(request)]
        if self.connector.request_finished(request, block_ids):
            assert block_ids, f"request {request.request_id!r}: the KV connector held no blocks"
            self.held[request.request_id] = self.kv.detach(request)
            return self.connector.finished_kv_transfer_params(request)
        self.kv.free(request)
        return None

    @property
    def busy(self) -> bool:
        """Blocks held or transfers pending: the engine has work even with no request left."""
        return bool(self.held) or self.connector.has_pending_transfers()

    def check_idle(self) -> None:
        leftovers = {"loading": sorted(self.loading), "held for transfers": sorted(self.held)}
        left = {name: ids[:16] for name, ids in leftovers.items() if ids}
        if left:
            raise AssertionError(f"KV transfers not idle: {left}")
        self.connector.check_idle()
