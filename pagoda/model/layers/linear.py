"""Linear layers that shard their weights across tensor-parallel ranks.

Column-parallel layers split the output features: each rank computes a slice of the output.
Row-parallel layers split the input features and all-reduce the partial sums. Every weight
carries a `weight_loader(param, loaded_weight, shard_id)` that copies this rank's slice out of
the checkpoint tensor (reading only that slice when the tensor is lazy), so model code and
checkpoints stay the same at any TP size.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from pagoda.distributed.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from pagoda.model import ops
from pagoda.model.layers.weight_utils import CheckpointWeight, copy_weight, narrow_weight

ShardId = int | str | None


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel split {denominator}")
    return numerator // denominator


def _new_parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class RankSlice(NamedTuple):
    """This rank's part of one checkpoint tensor: slice `index` of `count` slices of `rows` rows."""

    rows: int
    index: int
    count: int


class _ColumnShardedLinear(nn.Module):
    """y = x W^T + b with W's output rows split across ranks; the output stays sharded.

    `shards` maps each checkpoint tensor merged into this layer (its `shard_id`), in output
    order, to the slice this rank holds; the slices are stacked in that order.
    """

    def __init__(self, input_size: int, shards: dict[ShardId, RankSlice], bias: bool) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.shards = shards
        self.shard_offsets: dict[ShardId, int] = {}
        offset = 0
        for shard_id, rank_slice in shards.items():
            self.shard_offsets[shard_id] = offset
            offset += rank_slice.rows
        self.weight = _new_parameter(offset, input_size)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = _new_parameter(offset)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: CheckpointWeight, shard_id: ShardId = None) -> None:
        if shard_id not in self.shards:
            raise ValueError(f"unknown shard_id {shard_id!r}, expected one of {list(self.shards)}")
        rows, index, count = self.shards[shard_id]
        if loaded_weight.shape[0] != rows * count:
            raise ValueError(f"checkpoint tensor has {loaded_weight.shape[0]} rows, expected {rows * count}")
        dst = param.data.narrow(0, self.shard_offsets[shard_id], rows)
        copy_weight(dst, narrow_weight(loaded_weight, 0, index * rows, rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class ColumnParallelLinear(_ColumnShardedLinear):
    """A column-parallel layer loaded from one checkpoint tensor (shard_id None)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp_rank, tp_size = get_tp_rank(), get_tp_size()
        super().__init__(input_size, {None: RankSlice(divide(output_size, tp_size), tp_rank, tp_size)}, bias)


class MergedColumnParallelLinear(_ColumnShardedLinear):
    """Several column-parallel layers on the same input in one matmul (gate and up projections).

    Checkpoint tensor `i` (shard_id `i`) is split across ranks on its own, so each rank holds
    [its slice of tensor 0; its slice of tensor 1; ...].
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        tp_rank, tp_size = get_tp_rank(), get_tp_size()
        shards = {i: RankSlice(divide(size, tp_size), tp_rank, tp_size) for i, size in enumerate(output_sizes)}
        super().__init__(input_size, shards, bias)


class QKVParallelLinear(_ColumnShardedLinear):
    """The merged q, k, v projection (shard_ids "q", "k", "v"), split by attention head.

    Each rank gets `num_heads / tp` query heads. With fewer KV heads than ranks, each KV head is
    replicated on `tp / num_kv_heads` consecutive ranks, so every rank holds one.
    """

    def __init__(
        self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int, bias: bool = False
    ) -> None:
        tp_rank, tp_size = get_tp_rank(), get_tp_size()
        num_heads = divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            num_kv_heads, kv_index = 1, tp_rank // divide(tp_size, total_num_kv_heads)
        else:
            num_kv_heads, kv_index = divide(total_num_kv_heads, tp_size), tp_rank
        q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
        kv_slice = RankSlice(kv_size, kv_index, total_num_kv_heads // num_kv_heads)
        super().__init__(hidden_size, {"q": RankSlice(q_size, tp_rank, tp_size), "k": kv_slice, "v": kv_slice}, bias)
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.q_size, self.kv_size = q_size, kv_size


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split across ranks; partial sums are all-reduced.

    The input arrives already sharded (the output of a column-parallel layer). The bias is
    added once, on rank 0, before the all-reduce.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size_per_rank = divide(input_size, self.tp_size)
        self.weight = _new_parameter(output_size, self.input_size_per_rank)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = _new_parameter(output_size)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: CheckpointWeight, shard_id: None = None) -> None:
        if shard_id is not None:
            raise ValueError(f"RowParallelLinear has no shards, got shard_id {shard_id!r}")
        if param.ndim == 2:
            if loaded_weight.ndim != 2 or loaded_weight.shape[1] != self.input_size_per_rank * self.tp_size:
                raise ValueError(
                    f"checkpoint tensor shape {tuple(loaded_weight.shape)} does not fit {tuple(param.shape)}"
                )
            size = self.input_size_per_rank
            loaded_weight = narrow_weight(loaded_weight, 1, self.tp_rank * size, size)
        copy_weight(param.data, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = ops.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        return tensor_model_parallel_all_reduce(out)
