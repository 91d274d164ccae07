"""`LoRALinear`: the adapter slots of one base linear layer, added to its output by a hook.

The base layer is left as it is (its parameters, names, loaders and quantization unchanged); a
forward hook adds each token's adapter delta to its output. A merged layer (q/k/v, gate/up)
holds one output slice per checkpoint tensor merged into it, and each adapter's A/B of that
tensor go to the slice's rows: A stacked [slots, slices x R, in], B [slots, out, R] (R, the
padded rank, a power of two >= 16; ranks below it are zero-padded).

Tensor parallelism slices the adapters like the base layers: a column-parallel layer keeps
every column of A and this rank's rows of B (the rows of its weight); a row-parallel layer
keeps this rank's columns of A (its input shard), so its shrink is a partial sum, all-reduced
(T x R numbers) before the expand with the whole B adds to the already reduced output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagoda.distributed.parallel_state import tensor_model_parallel_all_reduce
from pagoda.lora import ops
from pagoda.lora.mapping import LoRABatchIndex
from pagoda.lora.peft_loader import PeftAdapter
from pagoda.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagoda.model.models.decoder import STACKED_PARAMS


@dataclass(frozen=True)
class OutputSlice:
    """One checkpoint tensor's part of a layer's output: the HF module it comes from (the
    adapter's key), its first output row here, its rows here, and which of `count` equal
    row blocks of the checkpoint tensor this rank holds."""

    hf_module: str
    offset: int
    rows: int
    index: int
    count: int


class LoRALinear:
    def __init__(
        self,
        base: nn.Module,
        slices: tuple[OutputSlice, ...],
        input_size: int,
        input_shard: tuple[int, int] | None,
        index: LoRABatchIndex,
        max_loras: int,
        rank: int,
        dtype: torch.dtype,
        use_triton: bool,
    ) -> None:
        """`input_shard` (rank, size): a row-parallel layer's part of the input; None: all of it.
        `dtype`: the activations' (an FP8 base layer's adapters stay in it)."""
        self.slices = slices
        self.input_shard = input_shard
        self.index = index
        self.rank = rank
        self.use_triton = use_triton
        device = next(base.parameters()).device
        output_size = sum(s.rows for s in slices)
        self.lora_a = torch.zeros(max_loras, len(slices) * rank, input_size, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, output_size, rank, dtype=dtype, device=device)
        self.output_slices = tuple((s.offset, s.rows) for s in slices)
        base.register_forward_hook(self._add_lora)

    def _add_lora(self, module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        (x,) = args
        h = ops.shrink(x, self.lora_a, self.index, self.use_triton)
        if self.input_shard is not None:
            h = tensor_model_parallel_all_reduce(h)
        ops.expand(output, h, self.lora_b, self.output_slices, self.index, self.use_triton)
        return output

    @torch.no_grad()
    def set_slot(self, slot: int, adapter: PeftAdapter) -> None:
        """Write `adapter`'s tensors for this layer into `slot` (zeros where it has none)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for i, part in enumerate(self.slices):
            pair = adapter.weights.get(part.hf_module)
            if pair is None:
                continue
            lora_a, lora_b = pair
            r = lora_a.shape[0]
            if self.input_shard is not None:
                shard, size = self.input_shard
                lora_a = lora_a.narrow(1, shard * size, size)
            self.lora_a[slot, i * self.rank : i * self.rank + r].copy_(lora_a)
            rows = lora_b.narrow(0, part.index * part.rows, part.rows)
            self.lora_b[slot, part.offset : part.offset + part.rows, :r].copy_(rows)


def _hf_name(module_name: str, ours: str, shard_id: int | str | None) -> str:
    if shard_id is None:
        return module_name
    hf = next(h for o, h, s in STACKED_PARAMS if o == ours and s == shard_id)
    return f"{module_name.removesuffix(ours)}{hf}"


def wrap_linear_layers(
    model: nn.Module, index: LoRABatchIndex, max_loras: int, rank: int, dtype: torch.dtype, use_triton: bool
) -> dict[str, LoRALinear]:
    """A `LoRALinear` on every q/k/v, o, gate/up and down projection of `model` (this rank's and
    this stage's), keyed by module name."""
    layers = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, QKVParallelLinear) or (
            isinstance(module, MergedColumnParallelLinear) and leaf == "gate_up_proj"
        ):
            slices = tuple(
                OutputSlice(_hf_name(name, leaf, shard_id), module.shard_offsets[shard_id], *rank_slice)
                for shard_id, rank_slice in module.shards.items()
            )
            input_size = module.linear_shape.input_size
            layers[name] = LoRALinear(module, slices, input_size, None, index, max_loras, rank, dtype, use_triton)
        elif isinstance(module, RowParallelLinear) and leaf in ("o_proj", "down_proj"):
            output_size = module.linear_shape.output_size
            slices = (OutputSlice(name, 0, output_size, 0, 1),)
            shard = (module.tp_rank, module.input_size_per_rank)
            input_size = module.input_size_per_rank
            layers[name] = LoRALinear(module, slices, input_size, shard, index, max_loras, rank, dtype, use_triton)
    return layers
