"""Static buffers with pinned host twins: fill on the host, send with one async copy.

`CpuGpuBuffer` sends itself. `PackedStaging` carves many of them out of one pinned host
allocation and one device allocation, so that a step's small inputs (ids, positions, slots,
lengths, ...) cross in one copy instead of one copy per buffer: each copy costs the host a
launch, which at a decode step's few hundred tokens is most of what sending them costs. The
device views keep fixed addresses, as the buffers CUDA graphs read must.
"""

from __future__ import annotations

import numpy as np
import torch

# Start of every packed buffer, in bytes (aligned vector loads; the caching allocator's granule).
_ALIGNMENT = 512
# Staged spans this close together are sent as one copy, the bytes between them included: on
# the device a copy of 256 KiB takes about what one more launch costs the host. On the CPU a
# "device" copy is a memcpy with no launch to save, so only touching spans merge there (a merged
# copy of 64 KiB or more also splits over torch's threads, and one of them descheduled on a
# loaded machine stalled it for milliseconds).
_MERGE_GAP_BYTES = 256 * 1024


class CpuGpuBuffer:
    def __init__(self, size: int, dtype: torch.dtype, device: torch.device, pin_memory: bool) -> None:
        self.cpu = torch.zeros(size, dtype=dtype, pin_memory=pin_memory)
        self.np: np.ndarray = self.cpu.numpy()
        self.gpu = torch.zeros(size, dtype=dtype, device=device)

    @classmethod
    def of_views(cls, cpu: torch.Tensor, gpu: torch.Tensor) -> CpuGpuBuffer:
        """A buffer over existing host and device tensors of one shape and dtype."""
        if cpu.shape != gpu.shape or cpu.dtype != gpu.dtype:
            raise ValueError(f"cpu {cpu.dtype}{list(cpu.shape)} and gpu {gpu.dtype}{list(gpu.shape)} must match")
        buffer = cls.__new__(cls)
        buffer.cpu, buffer.gpu = cpu, gpu
        buffer.np = cpu.numpy()
        return buffer

    def copy_to_gpu(self, n: int) -> torch.Tensor:
        """Send the first n entries; returns the device view of them."""
        self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.gpu[:n]


class PackedStaging:
    """Buffers in one pinned host tensor and one device tensor. `stage(buffer, n)` marks the
    first n entries of one of them for the next `send()`, which copies every marked span (in as
    few copies as their gaps allow, usually one). A device view handed out by `stage` holds the
    host's values only once `send()` is queued: nothing may read it on the device before."""

    def __init__(
        self,
        sizes: dict[str, tuple[int, torch.dtype]],
        device: torch.device,
        pin_memory: bool,
        merge_gap_bytes: int | None = None,
    ) -> None:
        """`merge_gap_bytes`: spans at most this far apart go in one copy (None: the device's
        default, see `_MERGE_GAP_BYTES`)."""
        offsets: dict[str, int] = {}
        total = 0
        for name, (size, dtype) in sizes.items():
            if size < 0:
                raise ValueError(f"size of staged buffer {name!r} must be >= 0, got {size}")
            offsets[name] = total
            total += -(size * dtype.itemsize // -_ALIGNMENT) * _ALIGNMENT
        self._host = torch.zeros(total, dtype=torch.uint8, pin_memory=pin_memory)
        self._device = torch.zeros(total, dtype=torch.uint8, device=device)
        if merge_gap_bytes is None:
            merge_gap_bytes = 0 if self._device.device.type == "cpu" else _MERGE_GAP_BYTES
        self._merge_gap = merge_gap_bytes
        self.buffers: dict[str, CpuGpuBuffer] = {}
        self._offset_of: dict[int, int] = {}
        for name, (size, dtype) in sizes.items():
            start, end = offsets[name], offsets[name] + size * dtype.itemsize
            buffer = CpuGpuBuffer.of_views(self._host[start:end].view(dtype), self._device[start:end].view(dtype))
            self.buffers[name] = buffer
            self._offset_of[id(buffer)] = start
        # Byte spans (start, end) marked since the last send.
        self._spans: list[tuple[int, int]] = []

    def __getitem__(self, name: str) -> CpuGpuBuffer:
        return self.buffers[name]

    def stage(self, buffer: CpuGpuBuffer, n: int) -> torch.Tensor:
        """Mark the first n entries of `buffer` (one of this staging's) for the next `send()`;
        returns their device view."""
        start = self._offset_of.get(id(buffer))
        if start is None:
            raise ValueError("buffer is not one of this PackedStaging's buffers")
        if n:
            self._spans.append((start, start + n * buffer.cpu.element_size()))
        return buffer.gpu[:n]

    def send(self) -> int:
        """Queue the copies of the marked spans; returns how many copies that took."""
        spans = sorted(self._spans)
        self._spans.clear()
        merged: list[list[int]] = []
        for start, end in spans:
            if merged and start - merged[-1][1] <= self._merge_gap:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        for start, end in merged:
            self._device[start:end].copy_(self._host[start:end], non_blocking=True)
        return len(merged)
