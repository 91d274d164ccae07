"""Tensor/pipeline-parallel groups. World size 1 today; layers already ask here for their
rank and size so that tensor parallelism does not need to rewrite the models."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1


_STATE = ParallelState()


def init_parallel_state(tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> None:
    global _STATE
    _STATE = ParallelState(tp_rank, tp_size, pp_rank, pp_size)


def get_tp_rank() -> int:
    return _STATE.tp_rank


def get_tp_size() -> int:
    return _STATE.tp_size


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _STATE.tp_size == 1:
        return x
    torch.distributed.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _STATE.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.tp_size)]
    torch.distributed.all_gather(parts, x)
    return torch.cat(parts, dim=dim)
