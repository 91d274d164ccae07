"""FP8 (e4m3) linear layers: weights quantized at load, or loaded as an FP8 checkpoint publishes them.

`Fp8Config` says where the FP8 weights come from and how their scales are laid out:
- quantized at load (`quantization="fp8"` on a bf16/fp16 checkpoint, dummy weights too): the
  weight loads in the model dtype and is quantized per output channel afterwards;
- compressed-tensors (`quant_method: compressed-tensors`): `weight` float8 with `weight_scale`
  per tensor ([1] or a scalar) or per channel ([N, 1]), and with static activations
  `input_scale` per tensor;
- HF's fp8 (`quant_method: fp8`): `weight` float8 with `weight_scale_inv` per block
  [N / bn, K / bk] (`weight_block_size`, usually [128, 128]) or one scalar, and with static
  activations `activation_scale`.

Activations are quantized dynamically (per token; per token and K-group for block-wise
weights) unless the checkpoint gives a static scale. After loading every layout becomes one of
two runtime forms: per-channel `weight_scale` [N] (a per-tensor scale repeated over its
shard's rows) or block-wise `weight_scale` [N / bn, K / bk]; `fp8_ops.fp8_linear` runs both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagoda.config import ConfigError
from pagoda.model.layers.quantization.base import (
    LinearMethod,
    LinearShape,
    QuantizationConfig,
    ScaleLayout,
    new_parameter,
)
from pagoda.model.layers.quantization.fp8_ops import FP8_DTYPE, fp8_linear, quantize_per_channel

if TYPE_CHECKING:
    from pagoda.model.layers.fused_moe import FusedMoEMethod

WEIGHT_STRATEGIES = ("channel", "tensor", "block")


@dataclass(frozen=True)
class Fp8Config(QuantizationConfig):
    """serialized: the checkpoint holds FP8 weights (else they are quantized at load).
    weight_strategy: "channel", "tensor" or "block" (with block_size (bn, bk)).
    static_input: the checkpoint holds per-tensor activation scales.
    weight_scale_name / input_scale_name: the checkpoint's names of those tensors."""

    serialized: bool = False
    weight_strategy: str = "channel"
    block_size: tuple[int, int] | None = None
    static_input: bool = False
    weight_scale_name: str = "weight_scale"
    input_scale_name: str = "input_scale"
    name: str = "fp8"

    def __post_init__(self) -> None:
        if self.weight_strategy not in WEIGHT_STRATEGIES:
            raise ConfigError(
                f"quantization_config weight strategy must be one of {', '.join(WEIGHT_STRATEGIES)}, "
                f"got {self.weight_strategy!r}"
            )
        if (self.weight_strategy == "block") != (self.block_size is not None):
            raise ConfigError("quantization_config.weight_block_size is given exactly for block-wise weights")
        if self.block_size is not None and (len(self.block_size) != 2 or min(self.block_size) < 1):
            raise ConfigError(f"quantization_config.weight_block_size must be two positive ints, got {self.block_size}")
        if not self.serialized and (self.weight_strategy != "channel" or self.static_input):
            raise ConfigError("quantizing at load makes per-channel weights with dynamic activations only")

    def linear_method(self) -> LinearMethod:
        return Fp8LinearMethod(self)

    def moe_method(self) -> FusedMoEMethod:
        if self.serialized:
            raise ConfigError(
                "FP8 checkpoints of mixture-of-experts models do not load yet: load the bf16 checkpoint "
                "with quantization='fp8' (experts quantized at load)"
            )
        from pagoda.model.layers.quantization.fp8_moe import Fp8FusedMoEMethod

        return Fp8FusedMoEMethod()


class Fp8LinearMethod(LinearMethod):
    """FP8 weight [N, K] with float32 scales (see the module docstring for the layouts)."""

    def __init__(self, config: Fp8Config) -> None:
        self.config = config

    def create_weights(self, layer: nn.Module, shape: LinearShape) -> None:
        config = self.config
        n, k = shape.output_size, shape.input_size
        if not config.serialized:
            layer.register_parameter("weight", new_parameter((n, k), None))
            return
        layer.register_parameter("weight", new_parameter((n, k), FP8_DTYPE))
        shards = len(shape.output_rows)
        if config.weight_strategy == "tensor":
            scale = new_parameter((shards,), torch.float32, ScaleLayout(per_shard=True))
        elif config.weight_strategy == "channel":
            scale = new_parameter((n, 1), torch.float32, ScaleLayout(cols_per_entry=0))
        else:
            bn, bk = self._check_blocks(shape)
            scale = new_parameter((n // bn, k // bk), torch.float32, ScaleLayout(rows_per_entry=bn, cols_per_entry=bk))
        layer.register_parameter(config.weight_scale_name, scale)
        if config.static_input:
            input_scale = new_parameter((shards,), torch.float32, ScaleLayout(per_shard=True))
            layer.register_parameter(config.input_scale_name, input_scale)

    def _check_blocks(self, shape: LinearShape) -> tuple[int, int]:
        assert self.config.block_size is not None
        bn, bk = self.config.block_size
        if any(rows % bn for rows in shape.output_rows) or shape.input_size % bk:
            raise ConfigError(
                f"quantization_config.weight_block_size {list(self.config.block_size)} must divide every "
                f"weight this rank holds: output rows {list(shape.output_rows)}, input columns {shape.input_size} "
                "(a smaller tensor_parallel_size may fit)"
            )
        return bn, bk

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        config = self.config
        if not config.serialized:
            weight, scale = quantize_per_channel(layer.weight.data)
            layer.weight = nn.Parameter(weight, requires_grad=False)
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)
            layer.input_scale = None
            return
        loaded_scale = getattr(layer, config.weight_scale_name).data
        delattr(layer, config.weight_scale_name)
        if config.weight_strategy == "tensor":
            rows = torch.tensor(layer.linear_shape.output_rows, device=loaded_scale.device)
            scale = loaded_scale.repeat_interleave(rows)
        elif config.weight_strategy == "channel":
            scale = loaded_scale.reshape(-1)
        else:
            scale = loaded_scale
        layer.weight_scale = nn.Parameter(scale.float().contiguous(), requires_grad=False)
        input_scale = None
        if config.static_input:
            input_scale = getattr(layer, config.input_scale_name).data.max()
            delattr(layer, config.input_scale_name)
        layer.input_scale = input_scale

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_linear(
            x,
            layer.weight,
            layer.weight_scale,
            block_size=self.config.block_size,
            input_scale=layer.input_scale,
            bias=bias,
        )
