"""`OffloadingWorker`: the worker half of CPU offload, running the scheduler's copy jobs.

On CUDA, saves run on a save stream and loads on a load stream (both high priority, each with
the copier's side stream for its gathers or scatters: see copier.py), each first waiting for the
work already queued on the compute stream (a block handed to a load may still be written by
an earlier step of its previous owner, in flight under async scheduling); a save of blocks
reused this step makes the compute stream wait for it. Completion is polled through events.
On the CPU, a save before the forward runs at once and the other jobs on one copy thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass

import torch

from pagoda.kv_cache_interface import KVCacheConfig
from pagoda.kv_transfer.interface import KVConnectorMetadata, KVConnectorOutput, KVTransferStats
from pagoda.kv_transfer.offload.copier import BlockCopier, cache_byte_views, copy_stream
from pagoda.kv_transfer.offload.scheduler import BlockCopyJob, OffloadMetadata
from pagoda.worker.kv_connector.base import KVConnector

logger = logging.getLogger(__name__)

# Device cycles per second of delay, for the injected load delay on CUDA (a rough clock rate).
_SLEEP_CYCLES_PER_S = 1.5e9


@dataclass
class TransferFaults:
    """Injected faults, for tests: the next `fail_loads` loads write garbage into their
    blocks and report failure; every load first waits `load_delay_s`."""

    fail_loads: int = 0
    load_delay_s: float = 0.0


class _Transfer:
    """One job in flight: its completion, duration and size."""

    def __init__(self, job: BlockCopyJob, kind: str, num_bytes: int, failed: bool) -> None:
        self.job = job
        self.kind = kind
        self.num_bytes = num_bytes
        self.failed = failed
        self.future: concurrent.futures.Future[float] | None = None
        self.events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def done(self) -> bool:
        if self.future is not None:
            return self.future.done()
        return self.events is None or self.events[1].query()

    def seconds_and_error(self) -> tuple[float, BaseException | None]:
        if self.future is not None:
            error = self.future.exception()
            return (0.0 if error is not None else self.future.result()), error
        if self.events is None:
            return 0.0, None
        return self.events[0].elapsed_time(self.events[1]) / 1e3, None


class OffloadingWorker(KVConnector):
    def __init__(self, num_host_blocks: int, num_tensors: int, page_bytes: int, device: torch.device) -> None:
        self.copier = BlockCopier(num_tensors, page_bytes, num_host_blocks, device)
        self.device = device
        self.faults = TransferFaults()
        self._metadata: OffloadMetadata | None = None
        self._in_flight: list[_Transfer] = []
        self._streams: dict[str, torch.cuda.Stream] = {}
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        if device.type == "cuda":
            self._streams = {kind: copy_stream(device) for kind in ("save", "load")}
        else:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagoda-kv-offload")
        logger.info(
            "KV offload: %d host blocks of %.2f MiB (%.2f GiB%s)",
            num_host_blocks,
            self.copier.block_bytes / 2**20,
            num_host_blocks * self.copier.block_bytes / 2**30,
            ", pinned" if device.type == "cuda" else "",
        )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], kv_cache_config: KVCacheConfig) -> None:
        self.copier.bind(cache_byte_views(kv_caches, kv_cache_config))

    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        assert metadata is None or isinstance(metadata, OffloadMetadata)
        self._metadata = metadata
        if metadata is not None:
            for job in metadata.saves:
                if job.before_forward:
                    self._start(job, "save")

    def start_load_kv(self) -> None:
        metadata, self._metadata = self._metadata, None
        if metadata is None:
            return
        for job in metadata.saves:
            if not job.before_forward:
                self._start(job, "save")
        for job in metadata.loads:
            self._start(job, "load")

    def _start(self, job: BlockCopyJob, kind: str) -> None:
        failed = kind == "load" and self.faults.fail_loads > 0
        if failed:
            self.faults.fail_loads -= 1
        transfer = _Transfer(job, kind, len(job.block_ids) * self.copier.block_bytes, failed)
        self._in_flight.append(transfer)
        if self._thread is not None:
            if kind == "save" and job.before_forward:
                started = time.perf_counter()
                self._copy(transfer)
                transfer.future = concurrent.futures.Future()
                transfer.future.set_result(time.perf_counter() - started)
            else:
                transfer.future = self._thread.submit(self._timed_copy, transfer)
            return
        stream = self._streams[kind]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        with torch.cuda.stream(stream):
            events[0].record(stream)
            if kind == "load" and self.faults.load_delay_s:
                torch.cuda._sleep(int(self.faults.load_delay_s * _SLEEP_CYCLES_PER_S))
            self._copy(transfer)
            events[1].record(stream)
        transfer.events = events
        if job.before_forward:
            torch.cuda.current_stream(self.device).wait_event(events[1])

    def _timed_copy(self, transfer: _Transfer) -> float:
        if transfer.kind == "load" and self.faults.load_delay_s:
            time.sleep(self.faults.load_delay_s)
        started = time.perf_counter()
        self._copy(transfer)
        return time.perf_counter() - started

    def _copy(self, transfer: _Transfer) -> None:
        job = transfer.job
        if transfer.kind == "save":
            self.copier.save(job.block_ids, job.slots)
        elif transfer.failed:
            self.copier.scribble(job.block_ids)
        else:
            self.copier.load(job.slots, job.block_ids)

    def get_finished(self, wait_s: float = 0.0) -> KVConnectorOutput | None:
        if not self._in_flight:
            return None
        if wait_s and not any(t.done() for t in self._in_flight):
            self._wait_any(wait_s)
        done = [t for t in self._in_flight if t.done()]
        if not done:
            return None
        self._in_flight = [t for t in self._in_flight if t not in done]
        names = ("finished_saves", "finished_loads", "failed_saves", "failed_loads")
        ids: dict[str, set[str]] = {name: set() for name in names}
        stats = KVTransferStats()
        for transfer in done:
            seconds, error = transfer.seconds_and_error()
            failed = transfer.failed or error is not None
            if error is not None:
                logger.warning("KV offload %s %s failed: %s", transfer.kind, transfer.job.job_id, error)
            ids[f"{'failed' if failed else 'finished'}_{transfer.kind}s"].add(transfer.job.job_id)
            if failed:
                stats.num_failed_transfers += 1
            elif transfer.kind == "load":
                stats.num_loads += 1
                stats.load_bytes += transfer.num_bytes
                stats.load_seconds += seconds
            else:
                stats.num_saves += 1
                stats.save_bytes += transfer.num_bytes
        return KVConnectorOutput(**{name: frozenset(value) for name, value in ids.items()}, stats=stats)

    def _wait_any(self, wait_s: float) -> None:
        futures = [t.future for t in self._in_flight if t.future is not None]
        if futures:
            concurrent.futures.wait(futures, timeout=wait_s, return_when=concurrent.futures.FIRST_COMPLETED)
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not any(t.done() for t in self._in_flight):
            time.sleep(5e-5)

    def check_idle(self) -> None:
        assert not self._in_flight, f"KV offload: {len(self._in_flight)} transfers still in flight"

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
