"""`ProducerWorker`: the producer's worker half, answering consumers' pulls of held blocks.

A server thread owns a ZMQ ROUTER socket on the producer's address. Exports arrive from the
scheduler half in each step's metadata (registered on the runner's thread, with an event on the
compute stream the copy waits for on CUDA); a pull of an export's blocks, with its token, is
copied into a fresh shared-memory segment and answered with the segment's name. The copy reads
blocks no one writes any more (held, out of every request), so it runs beside the forward, on a
stream of its own on CUDA. An acknowledgement, or the hold timeout, ends the export: its segment
is unlinked and the next `get_finished` reports it (`finished_saves` when pulled and
acknowledged, `failed_saves` when it expired), which frees the blocks. A pull may come a step
before its export is registered (the answer reaches the router first): it waits for it briefly.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from pagoda.kv_cache_interface import KVCacheConfig
from pagoda.kv_transfer.disagg import shm
from pagoda.kv_transfer.disagg.channel import ACK, PULL, ChannelError, decode, encode
from pagoda.kv_transfer.disagg.scheduler import ExportMetadata
from pagoda.kv_transfer.interface import KVConnectorMetadata, KVConnectorOutput, KVTransferStats
from pagoda.kv_transfer.offload.copier import BlockCopier, cache_byte_views, copy_on_stream, copy_stream
from pagoda.worker.kv_connector.base import KVConnector

logger = logging.getLogger(__name__)

# How long a pull waits for its export to be registered (it is, at the producer's next step).
REGISTRATION_WAIT_S = 5.0
# How often the server thread looks for expired exports while no message comes.
POLL_MS = 50


@dataclass
class _Export:
    token: str
    block_ids: frozenset[int]
    deadline: float
    # On CUDA: recorded on the compute stream when registered; the copy waits for it.
    ready: torch.cuda.Event | None
    # The segment of its last pull, until acknowledged or expired.
    segment: str | None = None


class ProducerWorker(KVConnector):
    def __init__(
        self, address: str, hold_timeout_s: float, num_tensors: int, page_bytes: int, device: torch.device
    ) -> None:
        self.address = address
        self.hold_timeout_s = hold_timeout_s
        self.copier = BlockCopier(num_tensors, page_bytes, 0, device, directions=("save",))
        self.on_cuda = device.type == "cuda"
        self._stream = copy_stream(device) if self.on_cuda else None
        self._changed = threading.Condition()
        self._exports: dict[str, _Export] = {}
        # Ended exports not reported yet: request id -> True when pulled and acknowledged.
        self._ended: dict[str, bool] = {}
        self._stats = KVTransferStats()
        removed = shm.remove_stale_segments()
        if removed:
            logger.info("KV producer: removed %d shared-memory segments left by dead processes", removed)
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._bind_error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="pagoda-kv-producer", daemon=True)
        self._thread.start()
        self._bound.wait()
        if self._bind_error is not None:
            raise RuntimeError(f"KV producer: cannot bind {address}: {self._bind_error}") from self._bind_error
        logger.info("KV producer: serving pulls on %s (blocks held up to %g s)", address, hold_timeout_s)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], kv_cache_config: KVCacheConfig) -> None:
        self.copier.bind(cache_byte_views(kv_caches, kv_cache_config))

    # ---- the runner's thread -----------------------------------------------------------------

    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        if metadata is None:
            return
        assert isinstance(metadata, ExportMetadata)
        if not metadata.exports:
            return
        ready = None
        if self.on_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.copier.device))
        deadline = time.monotonic() + self.hold_timeout_s
        with self._changed:
            for export in metadata.exports:
                self._exports[export.request_id] = _Export(export.token, frozenset(export.block_ids), deadline, ready)
            self._changed.notify_all()

    def get_finished(self, wait_s: float = 0.0) -> KVConnectorOutput | None:
        with self._changed:
            if wait_s and not self._ended and self._exports:
                self._changed.wait(wait_s)
            if not self._ended:
                return None
            ended, self._ended = self._ended, {}
            stats, self._stats = self._stats, KVTransferStats()
        stats.num_failed_transfers += sum(not acked for acked in ended.values())
        return KVConnectorOutput(
            finished_saves=frozenset(r for r, acked in ended.items() if acked),
            failed_saves=frozenset(r for r, acked in ended.items() if not acked),
            stats=stats,
        )

    def check_idle(self) -> None:
        with self._changed:
            assert not self._exports and not self._ended, f"KV producer: exports still held {sorted(self._exports)[:8]}"

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join()
        with self._changed:
            for export in self._exports.values():
                if export.segment is not None:
                    shm.unlink_segment(export.segment)

    # ---- the server thread -------------------------------------------------------------------

    def _serve(self) -> None:
        context = zmq.Context()
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.bind(self.address)
        except zmq.ZMQError as error:
            self._bind_error = error
            socket.close()
            context.term()
            return
        finally:
            self._bound.set()
        try:
            while not self._stop.is_set():
                if socket.poll(POLL_MS):
                    frames = socket.recv_multipart()
                    socket.send_multipart([*frames[:-1], encode(self._answer(frames[-1]))])
                self._expire(time.monotonic())
        finally:
            socket.close()
            context.term()

    def _answer(self, payload: bytes) -> dict[str, Any]:
        try:
            message = decode(payload)
            kind = message.get("kind")
            if kind == PULL:
                return self._pull(message)
            if kind == ACK:
                return self._ack(message)
            raise ChannelError(f"unknown message kind {kind!r}")
        except Exception as error:  # a bad or failed request is refused; the server serves on
            logger.warning("KV producer: refused a %s: %s", payload[:64], error)
            return {"ok": False, "error": str(error)}

    def _find(self, message: dict[str, Any], wait_s: float) -> tuple[str, _Export]:
        request_id = message.get("request_id")
        deadline = time.monotonic() + wait_s
        with self._changed:
            while (export := self._exports.get(request_id)) is None and (left := deadline - time.monotonic()) > 0:
                self._changed.wait(left)
        token = message.get("token")
        if export is None or not isinstance(token, str) or not hmac.compare_digest(export.token, token):
            raise ChannelError(f"no blocks held for request {request_id!r} with that token (expired or pulled)")
        return request_id, export

    def _pull(self, message: dict[str, Any]) -> dict[str, Any]:
        request_id, export = self._find(message, REGISTRATION_WAIT_S)
        block_ids = message.get("block_ids")
        if not isinstance(block_ids, list) or not block_ids or not all(b in export.block_ids for b in block_ids):
            raise ChannelError(f"block_ids must be a non-empty list of request {request_id!r}'s held blocks")
        if export.segment is not None:  # a retried pull: its earlier segment goes
            shm.unlink_segment(export.segment)
            export.segment = None
        started = time.perf_counter()
        segment = shm.create_segment(len(block_ids) * self.copier.block_bytes)
        try:
            self._copy_out(block_ids, segment, export.ready)
        except BaseException:
            shm.unlink_segment(segment.name)
            raise
        finally:
            segment.close()
        export.segment = segment.name  # only this thread ends exports: it is still held
        with self._changed:
            self._stats.num_saves += 1
            self._stats.save_bytes += segment.num_bytes
        logger.debug(
            "KV producer: %s: %d blocks in %.1f ms", request_id, len(block_ids), 1e3 * (time.perf_counter() - started)
        )
        return {
            "ok": True,
            "segment": segment.name,
            "num_blocks": len(block_ids),
            "block_bytes": self.copier.block_bytes,
        }

    def _copy_out(self, block_ids: list[int], segment: shm.Segment, ready: torch.cuda.Event | None) -> None:
        host = segment.blocks(self.copier.block_shape)
        slots = list(range(len(block_ids)))
        copy_on_stream(self._stream, ready, lambda: self.copier.save(block_ids, slots, host))

    def _ack(self, message: dict[str, Any]) -> dict[str, Any]:
        request_id, _ = self._find(message, 0.0)
        self._end(request_id, acked=True)
        return {"ok": True}

    def _end(self, request_id: str, acked: bool) -> None:
        with self._changed:
            export = self._exports.pop(request_id)
            if export.segment is not None:
                shm.unlink_segment(export.segment)
            self._ended[request_id] = acked
            self._changed.notify_all()

    def _expire(self, now: float) -> None:
        with self._changed:
            expired = [request_id for request_id, export in self._exports.items() if export.deadline <= now]
        for request_id in expired:
            logger.warning(
                "KV producer: request %r's blocks were not pulled within %g s; freeing them",
                request_id,
                self.hold_timeout_s,
            )
            self._end(request_id, acked=False)
