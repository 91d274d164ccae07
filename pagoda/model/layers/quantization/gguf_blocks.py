"""GGUF weights kept as the file's blocks (`gguf_weights="blocks"`), on the CPU.

Each linear layer holds `gguf_blocks`, uint8 [N, K / 32 * block bytes]: the file's bytes for its
rows (18 a block for Q4_0, 20 for Q4_1), so SmolLM2's 66 MB of 4-bit linears stay 66 MB instead
of 265 MB of float32. The token embedding and the LM head keep theirs too where the file stores
them as Q4_0, Q4_1 or Q8_0 (SmolLM2's tied Q8_0 embedding: 30 MB instead of 113), see
`VocabParallelEmbedding`. Up to `gguf_kernels.max_kernel_tokens()` tokens a step (8 with AVX2,
64 with AVX-512), `gguf_kernels.matmul` reads the blocks directly; a larger step dequantizes the
layer into a float32 scratch (`gguf_kernels.dequantize`, ~0.1-0.3 ms a SmolLM2 layer) and runs
one GEMM, where the 4-bit read no longer dominates. Both take the weights exactly as the loader
dequantizes them (the kernel multiplies their integers at a token, or dequantizes a few rows at a
time for more, see `gguf_kernels`), so only the activations' rounding and the sums' order differ
from the dequantized path. On the 2-core AVX2 machine (benchmarks/cpu_decode.py, float32,
two rounds alternating): a single stream 49.8 / 48.8 ms a token against 65.1 / 62.7
dequantized; 32 streams 100.3 / 102.8 tok/s against 112.2 / 108.4 (each such step dequantizes
every layer again); resident memory 715 MiB against 1,049.

Each layer's kernel runs on the engine's compute threads (`torch.get_num_threads()` when the
model is built), as the kernel's own team (see `gguf_kernels.matmul`).

One rank only: a row-parallel layer would split each row's blocks by bytes, which the layers'
loaders do not do (config.py refuses "blocks" with tensor parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagoda.config import ConfigError
from pagoda.model.layers.quantization import gguf_kernels
from pagoda.model.layers.quantization.base import (
    LinearMethod,
    LinearShape,
    QuantizationConfig,
    ScaleLayout,
    new_parameter,
)
from pagoda.model.layers.quantization.int4 import GROUP_SIZE


def blocks_linear(
    blocks: torch.Tensor, x: torch.Tensor, ggml_type: int, threads: int = 1, any_tokens: bool = False
) -> torch.Tensor:
    """x [..., K] times the weight whose rows are `blocks` transposed: float32 [..., N]; the
    kernel up to `gguf_kernels.max_kernel_tokens()` rows of x (any number with `any_tokens`),
    else dequantized and F.linear."""
    kernels = gguf_kernels.load()
    assert kernels is not None, "gguf_weights 'blocks' resolved without the kernels"
    flat = x.reshape(-1, x.shape[-1]).float().contiguous()
    if any_tokens or len(flat) <= gguf_kernels.max_kernel_tokens():
        out = gguf_kernels.matmul(kernels, blocks, flat, ggml_type, threads)
    else:
        out = torch.nn.functional.linear(flat, gguf_kernels.dequantize(kernels, blocks, ggml_type))
    return out.view(*x.shape[:-1], -1)


@dataclass(frozen=True)
class GGUFBlockConfig(QuantizationConfig):
    """Every linear layer holds GGUF blocks of `ggml_type` (Q4_0 or Q4_1: one type per file);
    the token embedding and the LM head hold blocks of their own types where those are set."""

    ggml_type: int
    embedding_type: int | None = None
    lm_head_type: int | None = None
    name: str = "gguf_blocks"

    def linear_method(self) -> LinearMethod:
        return GGUFBlockLinearMethod(self.ggml_type)

    def vocab_blocks_type(self, lm_head: bool) -> int | None:
        return self.lm_head_type if lm_head else self.embedding_type


class GGUFBlockLinearMethod(LinearMethod):
    """The file's blocks, multiplied by Pagoda's CPU kernels (see the module docstring)."""

    def __init__(self, ggml_type: int) -> None:
        self.ggml_type = ggml_type
        self.block_bytes = gguf_kernels.BLOCK_BYTES[ggml_type]
        # The engine's compute threads (set before the model is built): the kernel's team.
        self.threads = torch.get_num_threads()

    def create_weights(self, layer: nn.Module, shape: LinearShape) -> None:
        if shape.input_size % GROUP_SIZE:
            raise ConfigError(
                f"gguf_weights 'blocks' needs input columns divisible by {GROUP_SIZE}, a layer here has "
                f"{shape.input_size}: use gguf_weights='dequantized'"
            )
        row_bytes = shape.input_size // GROUP_SIZE * self.block_bytes
        # cols_per_entry 0: the layers' loaders copy each row whole (one rank, see config.py).
        layer.register_parameter(
            "gguf_blocks", new_parameter((shape.output_size, row_bytes), torch.uint8, ScaleLayout(cols_per_entry=0))
        )

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = blocks_linear(layer.gguf_blocks, x, self.ggml_type, self.threads).to(x.dtype)
        return out if bias is None else out + bias
