"""Shared-memory segments: files in /dev/shm mapped by a producer and a consumer on one host.

A segment holds one transfer's blocks in the offload tier's block-major layout ([num_blocks,
num_tensors, 2, page/2] bytes) as a uint8 tensor over the mapping. Names carry the creating
process's pid (`pagoda-kv-PID-N`), so a producer starting up removes the segments of producers
that died without unlinking theirs (`remove_stale_segments`); every other path unlinks its
segment: the consumer as soon as it has mapped it (the mapping outlives the name), the
producer on the pull's acknowledgement, its failure or its timeout.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import re
import tempfile

import torch

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
_NAME = re.compile(r"pagoda-kv-(\d+)-(\d+)")
_counter = itertools.count()


class Segment:
    """A mapped segment and its bytes as a tensor; `close` unmaps it (the tensor must be gone)."""

    def __init__(self, name: str, fd: int, num_bytes: int) -> None:
        self.name = name
        self.num_bytes = num_bytes
        try:
            self._map = mmap.mmap(fd, num_bytes)
        finally:
            os.close(fd)
        self.tensor: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)

    def blocks(self, block_shape: tuple[int, ...]) -> torch.Tensor:
        """The bytes as [num_blocks, *block_shape]."""
        assert self.tensor is not None, f"segment {self.name} is closed"
        return self.tensor.view(-1, *block_shape)

    def close(self) -> None:
        self.tensor = None
        self._map.close()


def _path(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a KV transfer segment name (pagoda-kv-PID-N)")
    return os.path.join(SHM_DIR, name)


def create_segment(num_bytes: int) -> Segment:
    """A new segment of `num_bytes` (> 0), readable and writable by this user only."""
    name = f"pagoda-kv-{os.getpid()}-{next(_counter)}"
    fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, num_bytes)
    except BaseException:
        os.close(fd)
        unlink_segment(name)
        raise
    return Segment(name, fd, num_bytes)


def open_segment(name: str, num_bytes: int) -> Segment:
    """Map an existing segment, which must hold exactly `num_bytes`."""
    fd = os.open(_path(name), os.O_RDWR)
    size = os.fstat(fd).st_size
    if size != num_bytes:
        os.close(fd)
        raise ValueError(f"segment {name} holds {size} bytes, expected {num_bytes}")
    return Segment(name, fd, num_bytes)


def unlink_segment(name: str) -> None:
    """Remove a segment's name (gone already is fine); its mappings stay valid until closed."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_path(name))


def segment_exists(name: str) -> bool:
    return os.path.exists(_path(name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_segments() -> int:
    """Unlink the segments of processes no longer alive; returns how many."""
    removed = 0
    for entry in os.listdir(SHM_DIR):
        match = _NAME.fullmatch(entry)
        if match is not None and not _alive(int(match.group(1))):
            unlink_segment(entry)
            removed += 1
    return removed
