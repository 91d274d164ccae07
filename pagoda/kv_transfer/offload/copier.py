"""`BlockCopier`: whole KV blocks between the device cache and a block-major host pool.

The device cache is one buffer per `KVCacheTensor`, laid out [2 (K, V), num_blocks, page/2]
bytes: a block is 2 x num_tensors scattered pieces (64 KiB each at the Llama-3.1-8B shape).
The host pool is [num_host_blocks, num_tensors, 2, page/2]: a block is one contiguous run of
every layer's K and V (2 MiB there), so it crosses PCIe as one large copy. On CUDA a block
is gathered on the device into a staging buffer (device-to-device, at HBM bandwidth) and the
staging rows go to or from the host in runs of consecutive slots; on the CPU the host pool is
addressed directly.

On CUDA a copy runs as a two-stage pipeline over two staging buffers: the PCIe copies on the
caller's stream (the copy engine) and the gathers or scatters on a side stream (the SMs), so
the copy engine fills one buffer while the other's kernels wait for SMs a forward on the
compute stream is using. Both streams are high priority: those small kernels are scheduled
ahead of the forward's waiting thread blocks instead of after the whole kernel.

The pool may be empty (`num_host_blocks` 0): disaggregated prefill copies between the cache
and one shared-memory segment per transfer, laid out the same way, passed as `host`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagoda.kv_cache_interface import KVCacheConfig

# Device staging per direction (both buffers): large enough for full-bandwidth copies, small
# next to the cache.
STAGING_BYTES = 128 << 20
# CUDA stream priority of the copy streams (lower is more urgent; clamped to the device's range).
COPY_STREAM_PRIORITY = -1


def pinned_empty(shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialized uint8 host tensor, page-locked with cudaHostRegister. torch's pinned
    allocator rounds each allocation up to a power of two (a 72 GiB pool would ask for 128);
    registering an ordinary allocation pins exactly its size."""
    host = torch.empty(shape, dtype=torch.uint8)
    error = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)
    if int(error) != 0:
        raise RuntimeError(f"cudaHostRegister of the {host.numel() / 2**30:.2f} GiB KV offload pool failed: {error}")
    return host


def _unregister(host: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(host.data_ptr())


def slot_runs(slots: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(first slot, first index, length) of each run of consecutive slots."""
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            yield slots[start], start, i - start
            start = i


def copy_on_stream(stream: torch.cuda.Stream | None, ready: torch.cuda.Event | None, copy: Callable[[], None]) -> None:
    """Run `copy` on `stream` once `ready` has fired and wait for it; with no stream (a CPU
    cache), run it here."""
    if stream is None:
        copy()
        return
    with torch.cuda.stream(stream):
        if ready is not None:
            stream.wait_event(ready)
        copy()
    stream.synchronize()


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """A high-priority stream for KV copies (see the module docstring)."""
    return torch.cuda.Stream(device, priority=COPY_STREAM_PRIORITY)


def cache_byte_views(kv_caches: dict[str, torch.Tensor], kv_cache_config: KVCacheConfig) -> list[torch.Tensor]:
    """One [2, num_blocks, page/2] byte view per KV-cache tensor (what `BlockCopier.bind` takes)."""
    num_blocks = kv_cache_config.num_blocks
    return [
        kv_caches[tensor.shared_by[0]].view(torch.uint8).view(2, num_blocks, -1)
        for tensor in kv_cache_config.kv_cache_tensors
    ]


class BlockCopier:
    def __init__(
        self,
        num_tensors: int,
        page_bytes: int,
        num_host_blocks: int,
        device: torch.device,
        directions: tuple[str, ...] = ("save", "load"),
    ) -> None:
        """`directions`: the copies it makes ("save": device to host, "load": host to device),
        each with its device staging on CUDA, allocated now so a profile run counts it."""
        if page_bytes % 2:
            raise ValueError(f"a KV page holds K and V halves, got {page_bytes} bytes")
        self.device = device
        self.on_cuda = device.type == "cuda"
        self.block_shape = (num_tensors, 2, page_bytes // 2)
        self.block_bytes = num_tensors * page_bytes
        shape = (num_host_blocks, *self.block_shape)
        if self.on_cuda and num_host_blocks:
            self.host = pinned_empty(shape)
            # Holding the tensor, the finalizer unregisters its memory before it can be freed.
            weakref.finalize(self, _unregister, self.host)
        else:
            self.host = torch.empty(shape, dtype=torch.uint8)
        staging_blocks = max(1, min(num_host_blocks or STAGING_BYTES, STAGING_BYTES // self.block_bytes))
        # Blocks per pipeline chunk: half the staging, so two chunks are in flight.
        self.chunk_blocks = max(1, staging_blocks // 2)
        num_buffers = 2 if staging_blocks > 1 else 1
        self._staging: dict[str, list[torch.Tensor]] = {}
        self._side: dict[str, torch.cuda.Stream] = {}
        self._freed: dict[str, list[torch.cuda.Event]] = {}
        if self.on_cuda:
            for kind in directions:
                self._staging[kind] = [
                    torch.empty((self.chunk_blocks, *self.block_shape), dtype=torch.uint8, device=device)
                    for _ in range(num_buffers)
                ]
                self._side[kind] = copy_stream(device)
                self._freed[kind] = [torch.cuda.Event() for _ in range(num_buffers)]
        self.caches: list[torch.Tensor] = []

    def bind(self, caches: Sequence[torch.Tensor]) -> None:
        """The device buffers, one per KV-cache tensor, each viewed as [2, num_blocks, page/2] bytes."""
        shapes = {tuple(cache.shape[::2]) for cache in caches}
        if len(caches) != self.block_shape[0] or shapes != {(2, self.block_shape[2])}:
            raise ValueError(
                f"KV caches {[tuple(c.shape) for c in caches]} do not match host blocks {self.block_shape}"
            )
        self.caches = list(caches)

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long).to(self.device, non_blocking=True)

    def save(self, block_ids: Sequence[int], slots: Sequence[int], host: torch.Tensor | None = None) -> None:
        """Device blocks to host slots (of `host`, default the pool): done now on the CPU,
        queued on the current stream on CUDA."""
        host = self.host if host is None else host
        if not self.on_cuda:
            gathered = torch.stack([cache.index_select(1, self._ids(block_ids)) for cache in self.caches])
            host.index_copy_(0, torch.tensor(slots, dtype=torch.long), gathered.permute(2, 0, 1, 3))
            return
        stream, side = self._enter_pipeline("save")
        with torch.cuda.stream(side):
            ids = self._ids(block_ids)
        for first, staging, freed in self._chunks("save", len(block_ids)):
            count = min(self.chunk_blocks, len(block_ids) - first)
            with torch.cuda.stream(side):
                side.wait_event(freed)  # the host copy of the buffer's last chunk is done
                chunk_ids = ids[first : first + count]
                for t, cache in enumerate(self.caches):
                    staging[:count, t].copy_(cache.index_select(1, chunk_ids).transpose(0, 1))
            stream.wait_stream(side)
            for slot, index, length in slot_runs(slots[first : first + count]):
                host[slot : slot + length].copy_(staging[index : index + length], non_blocking=True)
            freed.record(stream)

    def load(self, slots: Sequence[int], block_ids: Sequence[int], host: torch.Tensor | None = None) -> None:
        """Host slots (of `host`, default the pool) to device blocks: done now on the CPU,
        queued on the current stream on CUDA."""
        host = self.host if host is None else host
        if not self.on_cuda:
            source = host.index_select(0, torch.tensor(slots, dtype=torch.long))
            ids = self._ids(block_ids)
            for t, cache in enumerate(self.caches):
                cache.index_copy_(1, ids, source[:, t].transpose(0, 1))
            return
        stream, side = self._enter_pipeline("load")
        with torch.cuda.stream(side):
            ids = self._ids(block_ids)
        for first, staging, freed in self._chunks("load", len(block_ids)):
            count = min(self.chunk_blocks, len(block_ids) - first)
            stream.wait_event(freed)  # the scatter of the buffer's last chunk is done
            for slot, index, length in slot_runs(slots[first : first + count]):
                staging[index : index + length].copy_(host[slot : slot + length], non_blocking=True)
            side.wait_stream(stream)
            with torch.cuda.stream(side):
                chunk_ids = ids[first : first + count]
                for t, cache in enumerate(self.caches):
                    cache.index_copy_(1, chunk_ids, staging[:count, t].transpose(0, 1))
                freed.record(side)
        stream.wait_stream(side)

    def _enter_pipeline(self, kind: str) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """The caller's stream and `kind`'s side stream, which first waits for what the caller
        queued (its copies may depend on it). A staging buffer is reused only after the event
        of its last chunk, in this copy or an earlier one on any stream."""
        stream = torch.cuda.current_stream(self.device)
        side = self._side[kind]
        side.wait_stream(stream)
        return stream, side

    def _chunks(self, kind: str, num_blocks: int) -> Iterator[tuple[int, torch.Tensor, torch.cuda.Event]]:
        """(first block index, its staging buffer, the event that frees that buffer) per chunk."""
        buffers, freed = self._staging[kind], self._freed[kind]
        for k, first in enumerate(range(0, num_blocks, self.chunk_blocks)):
            yield first, buffers[k % len(buffers)], freed[k % len(buffers)]

    def scribble(self, block_ids: Sequence[int]) -> None:
        """Fill device blocks with 0xFF bytes (NaN in every float format): what a load that
        broke off half way may leave, for the failure tests."""
        ids = self._ids(block_ids)
        for cache in self.caches:
            cache.index_fill_(1, ids, 0xFF)
