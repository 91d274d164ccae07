"""`ConsumerWorker`: the consumer's worker half, pulling a request's blocks from its producer.

Each `BlockPull` runs on one copy thread: ask the producer for the blocks (a fresh REQ socket,
answer within `timeout_s`), map the segment it names and unlink it at once (the mapping stays,
the name is gone whatever happens next), copy it into the request's fresh blocks, acknowledge.
On CUDA the copy runs on a stream of its own after the work queued on the compute stream when
the pull started (a fresh block's previous owner may still be written by a step in flight) and
is synchronized before the pull counts as done. Any failure (no answer, a refusal, a segment of
the wrong size) reports the load failed, and its request recomputes; an acknowledgement is sent
once the producer answered, whatever the copy did, so it frees its blocks without waiting for
its timeout.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any

import torch
import zmq

from pagoda.kv_cache_interface import KVCacheConfig
from pagoda.kv_transfer.disagg import shm
from pagoda.kv_transfer.disagg.channel import ACK, PULL, ChannelError, ControlClient
from pagoda.kv_transfer.disagg.scheduler import BlockPull, PullMetadata
from pagoda.kv_transfer.interface import KVConnectorMetadata, KVConnectorOutput, KVTransferStats
from pagoda.kv_transfer.offload.copier import BlockCopier, cache_byte_views, copy_on_stream, copy_stream
from pagoda.worker.kv_connector.base import KVConnector

logger = logging.getLogger(__name__)

# How long an acknowledgement waits for its answer (the blocks are in place already).
ACK_TIMEOUT_S = 1.0


class ConsumerWorker(KVConnector):
    def __init__(self, num_tensors: int, page_bytes: int, device: torch.device, timeout_s: float) -> None:
        self.copier = BlockCopier(num_tensors, page_bytes, 0, device, directions=("load",))
        self.timeout_s = timeout_s
        self.on_cuda = device.type == "cuda"
        self._stream = copy_stream(device) if self.on_cuda else None
        self._context = zmq.Context()
        # One thread: on CUDA the copier's staging buffer serves one copy at a time.
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagoda-kv-consumer")
        self._metadata: PullMetadata | None = None
        self._in_flight: dict[str, tuple[BlockPull, concurrent.futures.Future[float]]] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], kv_cache_config: KVCacheConfig) -> None:
        self.copier.bind(cache_byte_views(kv_caches, kv_cache_config))

    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        assert metadata is None or isinstance(metadata, PullMetadata)
        self._metadata = metadata

    def start_load_kv(self) -> None:
        metadata, self._metadata = self._metadata, None
        if metadata is None or not metadata.pulls:
            return
        ready = None
        if self.on_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.copier.device))
        for pull in metadata.pulls:
            self._in_flight[pull.job_id] = (pull, self._thread.submit(self._pull, pull, ready))

    def get_finished(self, wait_s: float = 0.0) -> KVConnectorOutput | None:
        if not self._in_flight:
            return None
        futures = [future for _, future in self._in_flight.values()]
        if wait_s:
            concurrent.futures.wait(futures, timeout=wait_s, return_when=concurrent.futures.FIRST_COMPLETED)
        done = [job_id for job_id, (_, future) in self._in_flight.items() if future.done()]
        if not done:
            return None
        stats = KVTransferStats()
        finished, failed = set(), set()
        for job_id in done:
            pull, future = self._in_flight.pop(job_id)
            error = future.exception()
            if error is not None:
                logger.warning("KV pull of request %r failed (it recomputes): %s", pull.remote_request_id, error)
                failed.add(job_id)
                stats.num_failed_transfers += 1
                continue
            finished.add(job_id)
            stats.num_loads += 1
            stats.load_bytes += len(pull.block_ids) * self.copier.block_bytes
            stats.load_seconds += future.result()
        return KVConnectorOutput(finished_loads=frozenset(finished), failed_loads=frozenset(failed), stats=stats)

    def check_idle(self) -> None:
        assert not self._in_flight, f"KV consumer: {len(self._in_flight)} pulls still in flight"

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)
        self._context.term()

    # ---- the copy thread -----------------------------------------------------------------------

    def _pull(self, pull: BlockPull, ready: torch.cuda.Event | None) -> float:
        """Pull one request's blocks; returns the seconds it took, or raises."""
        started = time.perf_counter()
        client = ControlClient(self._context, pull.remote_address)
        ask = {"request_id": pull.remote_request_id, "token": pull.remote_token}
        try:
            reply = client.call({"kind": PULL, **ask, "block_ids": list(pull.remote_block_ids)}, self.timeout_s)
            try:
                self._copy_in(pull, reply, ready)
            finally:
                try:
                    client.call({"kind": ACK, **ask}, ACK_TIMEOUT_S)
                except ChannelError as error:  # the producer frees the blocks at its timeout instead
                    logger.info("KV pull of request %r: no acknowledgement: %s", pull.remote_request_id, error)
        finally:
            client.close()
        return time.perf_counter() - started

    def _copy_in(self, pull: BlockPull, reply: dict[str, Any], ready: torch.cuda.Event | None) -> None:
        num_blocks = len(pull.block_ids)
        if reply.get("num_blocks") != num_blocks or reply.get("block_bytes") != self.copier.block_bytes:
            raise ChannelError(
                f"the producer sent {reply.get('num_blocks')} blocks of {reply.get('block_bytes')} bytes, expected "
                f"{num_blocks} of {self.copier.block_bytes} (is it serving the same model and dtype?)"
            )
        name = reply.get("segment")
        if not isinstance(name, str):
            raise ChannelError(f"the producer named no segment: {reply}")
        try:
            segment = shm.open_segment(name, num_blocks * self.copier.block_bytes)
        finally:
            shm.unlink_segment(name)
        try:
            self._load(segment, pull.block_ids, ready)
        finally:
            segment.close()

    def _load(self, segment: shm.Segment, block_ids: tuple[int, ...], ready: torch.cuda.Event | None) -> None:
        host = segment.blocks(self.copier.block_shape)
        slots = list(range(len(block_ids)))
        copy_on_stream(self._stream, ready, lambda: self.copier.load(slots, block_ids, host))
