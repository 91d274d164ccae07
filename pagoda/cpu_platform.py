"""What the host CPU offers the engine: usable cores, native bfloat16 math, and the thread settings.

A leaf module (it imports nothing from pagoda), so the config can size its defaults from it.
Thread counts are set once, when a CPU worker starts: more compute threads than the process
may run on make every parallel region wait at its barrier for a descheduled thread.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

# Environment variables that size thread pools (OpenMP, MKL, OpenBLAS in child processes, read
# once at their start; Rust's rayon, which HF tokenizers batch-encode on, read when this process
# or a child first encodes a batch).
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS")


def usable_cpu_count() -> int:
    """The CPUs this process may run on (its affinity, where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_has_native_bf16() -> bool:
    """Whether the CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX tiles): there bf16
    halves the bytes a decode step reads at no cost in speed; elsewhere oneDNN emulates it."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def configure_cpu_threads(num_threads: int) -> None:
    """Run torch's compute on `num_threads` threads, one inter-op thread (the engine issues its
    ops from one thread), and let the tokenizer's pool and child processes take the same count."""
    torch.set_num_threads(num_threads)
    if torch.get_num_interop_threads() != 1:
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            # Settable only before the process's first inter-op work; the pool then stays idle.
            logger.debug("inter-op threads already started: left at %d", torch.get_num_interop_threads())
    for name in THREAD_ENV_VARS:
        os.environ[name] = str(num_threads)
