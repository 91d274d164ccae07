"""Linear layers that shard their weights across tensor-parallel ranks.

Column-parallel layers split the output features: each rank computes a slice of the output.
Row-parallel layers split the input features and all-reduce the partial sums. Every weight
carries a `weight_loader(param, loaded_weight, shard_id)` that copies this rank's slice out of
the checkpoint tensor (reading only that slice when the tensor is lazy), so model code and
checkpoints stay the same at any TP size.

How a layer holds its weight and multiplies by it is its `quant_method` (a `LinearMethod`,
unquantized unless the model is built under a quantization config): the method registers the
weight and any scales, each carrying a `ScaleLayout` that tells the layer's loader how to
slice it (scales follow their weight's rows or blocks), and runs the product.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from pagoda.distributed.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from pagoda.model.layers.quantization.base import LinearShape, ScaleLayout, current_linear_method
from pagoda.model.layers.weight_utils import CheckpointWeight, copy_weight, narrow_weight, whole_weight

ShardId = int | str | None


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel split {denominator}")
    return numerator // denominator


def _new_parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _copy_per_shard_scalar(param: nn.Parameter, index: int, loaded_weight: CheckpointWeight) -> None:
    """A per-tensor scale (shape [] or [1] in checkpoints) into entry `index` of `param`."""
    if loaded_weight.shape.numel() != 1:
        raise ValueError(f"expected a per-tensor scale (one element), got shape {tuple(loaded_weight.shape)}")
    copy_weight(param.data.narrow(0, index, 1), whole_weight(loaded_weight).reshape(1))


class LinearBase(nn.Module):
    """What every linear layer shares: a `quant_method` from the quantization in effect while the
    model is built, which registers the weights and converts them once loaded."""

    def _build_weights(self, shape: LinearShape) -> None:
        """Let the linear method register its parameters, each loaded by this layer's loader."""
        self.linear_shape = shape
        self.quant_method = current_linear_method()
        self.quant_method.create_weights(self, shape)
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)


class RankSlice(NamedTuple):
    """This rank's part of one checkpoint tensor: slice `index` of `count` slices of `rows` rows."""

    rows: int
    index: int
    count: int


# How the weight itself (and a bias) is sliced: row for row, column for column.
_WEIGHT_LAYOUT = ScaleLayout()


class _ColumnShardedLinear(LinearBase):
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
        self._build_weights(LinearShape(input_size, tuple(rank_slice.rows for rank_slice in shards.values())))
        if bias:
            self.bias = _new_parameter(offset)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: CheckpointWeight, shard_id: ShardId = None) -> None:
        if shard_id not in self.shards:
            raise ValueError(f"unknown shard_id {shard_id!r}, expected one of {list(self.shards)}")
        layout = getattr(param, "scale_layout", _WEIGHT_LAYOUT)
        if layout.per_shard:
            _copy_per_shard_scalar(param, list(self.shards).index(shard_id), loaded_weight)
            return
        rows, index, count = self.shards[shard_id]
        rows_per_entry = layout.rows_per_entry
        if rows % rows_per_entry:
            raise ValueError(f"{rows} rows per rank are not whole blocks of {rows_per_entry} rows")
        entries = rows // rows_per_entry
        if loaded_weight.shape[0] != entries * count:
            raise ValueError(f"checkpoint tensor has {loaded_weight.shape[0]} rows, expected {entries * count}")
        dst = param.data.narrow(0, self.shard_offsets[shard_id] // rows_per_entry, entries)
        copy_weight(dst, narrow_weight(loaded_weight, 0, index * entries, entries))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


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


class RowParallelLinear(LinearBase):
    """y = x W^T + b with W's input columns split across ranks; partial sums are all-reduced.

    The input arrives already sharded (the output of a column-parallel layer). The bias is
    added once, on rank 0, before the all-reduce.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size_per_rank = divide(input_size, self.tp_size)
        self._build_weights(LinearShape(self.input_size_per_rank, (output_size,)))
        if bias:
            self.bias = _new_parameter(output_size)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: CheckpointWeight, shard_id: None = None) -> None:
        if shard_id is not None:
            raise ValueError(f"RowParallelLinear has no shards, got shard_id {shard_id!r}")
        layout = getattr(param, "scale_layout", None)
        if layout is not None and layout.per_shard:
            _copy_per_shard_scalar(param, 0, loaded_weight)
            return
        # Columns of the input one entry of dim 1 covers; 0: dim 1 is not split (a bias).
        cols_per_entry = layout.cols_per_entry if layout is not None else (1 if param.ndim == 2 else 0)
        if cols_per_entry:
            if self.input_size_per_rank % cols_per_entry:
                raise ValueError(
                    f"{self.input_size_per_rank} columns per rank are not whole blocks of {cols_per_entry}"
                )
            size = self.input_size_per_rank // cols_per_entry
            if loaded_weight.ndim != 2 or loaded_weight.shape[1] != size * self.tp_size:
                raise ValueError(
                    f"checkpoint tensor shape {tuple(loaded_weight.shape)} does not fit {tuple(param.shape)}"
                )
            loaded_weight = narrow_weight(loaded_weight, 1, self.tp_rank * size, size)
        copy_weight(param.data, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        return tensor_model_parallel_all_reduce(out)
