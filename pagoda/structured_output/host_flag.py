"""`HostFlag`: a counter in pinned host memory that a CUDA stream can wait for.

The host thread that fills step N+1's grammar masks finishes while step N+1's forward runs;
the sampler after that forward must not start before. Waiting on the host to queue the
sampler only then would chain the mask work to the host's other work for the next step (the
device idles while the host catches up). Instead the sampler is queued at once, behind a
one-program kernel on a side stream that polls the counter in mapped pinned memory (volatile
loads: every read goes to the host's memory) until the thread has written the step's number.
"""

from __future__ import annotations

import logging

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional off the GPU
    triton = None

logger = logging.getLogger(__name__)


class HostFlag:
    def __init__(self) -> None:
        self._value = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        self._view = self._value.numpy()
        self.usable = triton is not None

    def set(self, value: int) -> None:
        """From any thread: one aligned 8-byte store."""
        self._view[0] = value

    def wait_on_device(self, target: int, stream: torch.cuda.Stream) -> bool:
        """Queue on `stream` a wait until the counter reaches `target`; False (and the flag no
        longer used) where the kernel cannot read host memory, and the caller waits on the host."""
        if not self.usable:
            return False
        try:
            with torch.cuda.stream(stream):
                _wait_kernel[(1,)](self._value, target, num_warps=1)
        except (ValueError, RuntimeError) as error:  # e.g. a build whose pinned memory is not mapped
            logger.warning("grammar masks: the device cannot poll host memory (%s); waiting on the host", error)
            self.usable = False
            return False
        return True


if triton is not None:

    @triton.jit
    def _wait_kernel(flag_ptr, target):
        value = tl.load(flag_ptr, volatile=True)
        while value < target:
            value = tl.load(flag_ptr, volatile=True)
