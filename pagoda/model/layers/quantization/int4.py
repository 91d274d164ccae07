"""4-bit weights in groups of 32 along the input, run by torch's CPU int4 kernel.

What GGUF's Q4_0/Q4_1 linear weights load as on the CPU (`gguf_weights="quantized"`), so a
decode step reads 0.625 bytes per weight instead of bf16's 2: `_weight_int4pack_mm_for_cpu`
multiplies a bf16 activation by the packed nibbles, dequantizing w = (q - 8) scale + zero per
group and accumulating in float32, so only the scale and zero (bf16: GGUF's fp16 `d` loses 3
mantissa bits) and the output round. At one token on the AVX-512 BF16 CPU, a 1536 x 576 layer
took 26 us against 104 us for bf16 `F.linear` (one thread); from ~32 tokens bf16's GEMM is
faster (495 us against 249). SmolLM2 on 2 cores: batch-1 decode ~1.5x faster, but a 32 x 64
token prefill took 3.1 s against 1.6 s and batch-32 decoding ran ~0.85x (benchmarks/cpu_decode.py).

Loading: `qweight` uint8 [N, K / 2] (column 2i in the low nibble, 2i + 1 in the high one) and
float32 `weight_scale`, `weight_zero` [N, K / 32], sliced for tensor parallelism by the layer's
loader like any weight (merged q/k/v and gate/up rows stack before packing). After loading they
become the kernel's packed `int4_weight` [N, K / 2] (an ISA-specific layout, hence a new name:
refilling it from a checkpoint would be wrong) and bf16 `scales_and_zeros` [K / 32, N, 2].

The kernel is fast with bf16 activations only (a float32 input ran ~100x slower), so a float32
model's inputs are rounded to bf16 for these layers and the output cast back. Its speed needs
ATen's AVX-512 build: the AVX2 one was slower than float32 F.linear, so "auto" picks this only
with AVX-512 (see config.py); an AVX-512 CPU without BF16 instructions is unmeasured.
"""

from __future__ import annotations

from dataclasses import dataclass

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

GROUP_SIZE = 32
# The CPU packing works on 16 output rows at a time.
ROWS_MULTIPLE = 16
_KERNEL_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Int4Config(QuantizationConfig):
    """Every linear layer holds int4 groups of `GROUP_SIZE` (loaded from a GGUF's Q4_0/Q4_1)."""

    name: str = "int4"

    def linear_method(self) -> LinearMethod:
        return Int4LinearMethod()


def unpack_nibbles(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] (low nibble first) -> int32 [N, K] values in 0..15."""
    return torch.stack([qweight & 0x0F, qweight >> 4], dim=-1).reshape(qweight.shape[0], -1).to(torch.int32)


class Int4LinearMethod(LinearMethod):
    """Packed int4 weight with bf16 per-group scales and zeros (see the module docstring)."""

    def create_weights(self, layer: nn.Module, shape: LinearShape) -> None:
        n, k = shape.output_size, shape.input_size
        if k % GROUP_SIZE or n % ROWS_MULTIPLE:
            raise ConfigError(
                f"gguf_weights 'quantized' needs input columns divisible by {GROUP_SIZE} and output rows by "
                f"{ROWS_MULTIPLE} per rank, a layer here has {k} and {n}: use gguf_weights='dequantized'"
            )
        groups = k // GROUP_SIZE
        layer.register_parameter("qweight", new_parameter((n, k // 2), torch.uint8, ScaleLayout(cols_per_entry=2)))
        for name in ("weight_scale", "weight_zero"):
            param = new_parameter((n, groups), torch.float32, ScaleLayout(cols_per_entry=GROUP_SIZE))
            layer.register_parameter(name, param)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_nibbles(layer.qweight.data), 1)
        scales_and_zeros = torch.stack([layer.weight_scale.data, layer.weight_zero.data], dim=-1)
        for name in ("qweight", "weight_scale", "weight_zero"):
            delattr(layer, name)
        layer.int4_weight = nn.Parameter(packed, requires_grad=False)
        layer.scales_and_zeros = nn.Parameter(
            scales_and_zeros.transpose(0, 1).to(_KERNEL_DTYPE).contiguous(), requires_grad=False
        )

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(_KERNEL_DTYPE).contiguous(), layer.int4_weight, GROUP_SIZE, layer.scales_and_zeros
        ).to(x.dtype)
        return out if bias is None else out + bias
