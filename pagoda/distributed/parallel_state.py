"""Tensor- and pipeline-parallel groups over `torch.distributed`.

Ranks are laid out pipeline-major: rank = pp_rank * tp_size + tp_rank, so the ranks of one
pipeline stage (one tensor-parallel group) are consecutive, which keeps each stage on
neighbouring GPUs of a node. Layers ask here for their rank and size, so model code is the
same at any parallel size; at world size 1 nothing is initialized and every collective is
the identity.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from pagoda.distributed.one_shot import OneShotAllReduce, try_one_shot_all_reduce

# Collectives that wait longer than this on a peer raise instead of hanging forever (gloo).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


@dataclass
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    # Process groups of this rank (None at world size 1).
    tp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    pp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    # Global ranks of this rank's pipeline (one per stage), for stage-to-stage sends.
    pp_ranks: list[int] = field(default_factory=lambda: [0])
    # The tensor-parallel group's all-reduce for small messages (CUDA), None: NCCL for all.
    one_shot: OneShotAllReduce | None = field(default=None, repr=False)

    @property
    def is_first_pp_rank(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp_rank(self) -> bool:
        return self.pp_rank == self.pp_size - 1


_STATE = ParallelState()


def init_parallel_state(tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> None:
    """Set this process's ranks without process groups: for world size 1, and for tests that
    build one rank's slice of a model without running it."""
    global _STATE
    _STATE = ParallelState(tp_rank, tp_size, pp_rank, pp_size, pp_ranks=[tp_rank + k * tp_size for k in range(pp_size)])


def init_distributed_environment(
    rank: int,
    tp_size: int,
    pp_size: int,
    distributed_init_method: str | None,
    device: torch.device,
    one_shot_all_reduce: bool = True,
) -> None:
    """Join the world (NCCL on CUDA, gloo on the CPU) and build this rank's TP and PP groups.

    Every rank creates every group, in the same order, as `new_group` requires. On CUDA the
    TP group also gets a one-shot all-reduce for small messages unless `one_shot_all_reduce`
    is off.
    """
    global _STATE
    world_size = tp_size * pp_size
    if world_size == 1:
        init_parallel_state()
        return
    if distributed_init_method is None:
        raise ValueError("distributed_init_method is needed when tensor_parallel_size x pipeline_parallel_size > 1")
    backend = "nccl" if device.type == "cuda" else "gloo"
    # The PP group carries only sends and receives; NCCL warns that they serialize on it.
    os.environ.setdefault("TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING", "false")
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            init_method=distributed_init_method,
            world_size=world_size,
            rank=rank,
            timeout=COLLECTIVE_TIMEOUT,
            device_id=device if device.type == "cuda" else None,
        )
    tp_rank, pp_rank = rank % tp_size, rank // tp_size
    tp_group = pp_group = None
    for stage in range(pp_size):
        group = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)), backend=backend)
        if stage == pp_rank:
            tp_group = group
    pp_ranks = [tp_rank + k * tp_size for k in range(pp_size)]
    for column in range(tp_size):
        group = dist.new_group([column + k * tp_size for k in range(pp_size)], backend=backend)
        if column == tp_rank:
            pp_group = group
    one_shot = None
    if one_shot_all_reduce and backend == "nccl" and tp_size > 1:
        one_shot = try_one_shot_all_reduce(tp_group, device)
    _STATE = ParallelState(tp_rank, tp_size, pp_rank, pp_size, tp_group, pp_group, pp_ranks, one_shot)


def free_port() -> int:
    """A TCP port free on this host now, for a rendezvous (`distributed_init_method`) or a server."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def destroy_distributed_environment() -> None:
    global _STATE
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE = ParallelState()


def get_parallel_state() -> ParallelState:
    return _STATE


def get_tp_rank() -> int:
    return _STATE.tp_rank


def get_tp_size() -> int:
    return _STATE.tp_size


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel group (in place, or a new tensor for small messages)."""
    if _STATE.tp_size == 1:
        return x
    if _STATE.one_shot is not None and _STATE.one_shot.fits(x):
        return _STATE.one_shot(x)
    dist.all_reduce(x, group=_STATE.tp_group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (rank order)."""
    if _STATE.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=_STATE.tp_group)
    return torch.cat(parts, dim=dim)


def pp_send(tensors: list[torch.Tensor]) -> None:
    """Send `tensors` to the next pipeline stage (the same tensor-parallel rank there)."""
    dst = _STATE.pp_ranks[_STATE.pp_rank + 1]
    for tensor in tensors:
        dist.send(tensor.contiguous(), dst=dst, group=_STATE.pp_group)


def pp_recv(buffers: list[torch.Tensor]) -> None:
    """Fill `buffers` (shapes known to both stages) from the previous pipeline stage."""
    src = _STATE.pp_ranks[_STATE.pp_rank - 1]
    for buffer in buffers:
        dist.recv(buffer, src=src, group=_STATE.pp_group)


def get_pp_layer_range(num_layers: int, pp_rank: int | None = None, pp_size: int | None = None) -> tuple[int, int]:
    """[start, end) of the layers pipeline stage `pp_rank` (default: this rank's) owns: an even
    split, the first `num_layers % pp_size` stages taking one more."""
    pp_rank = _STATE.pp_rank if pp_rank is None else pp_rank
    pp_size = _STATE.pp_size if pp_size is None else pp_size
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (pp_rank < extra)
