"""The seam between a linear layer and how its weight is stored and multiplied.

A `LinearMethod` owns a layer's weight parameters: it registers them (`create_weights`), turns
what the checkpoint filled into what its kernel reads (`process_weights_after_loading`, once,
after every tensor is loaded), and computes y = x W^T + b (`apply`). The layer owns the
tensor-parallel split: every parameter a method registers is sliced by the layer's own
`weight_loader`, following the attributes the method sets on it (see `ScaleLayout`).

Which method each layer gets comes from the `QuantizationConfig` in effect while the model is
built (`building_with`), so models never pass quantization settings down their constructors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagoda.model import ops
from pagoda.model.layers.batch_invariance import batch_invariant_now

if TYPE_CHECKING:
    from pagoda.model.layers.fused_moe import FusedMoEMethod


@dataclass(frozen=True)
class LinearShape:
    """This rank's part of a linear layer: `input_size` columns and `output_rows` rows per
    merged checkpoint tensor (one entry for a plain layer, q/k/v or gate/up for merged ones)."""

    input_size: int
    output_rows: tuple[int, ...]

    @property
    def output_size(self) -> int:
        return sum(self.output_rows)


@dataclass(frozen=True)
class ScaleLayout:
    """How the layer's weight loader slices a parameter, set on it as `param.scale_layout`.

    rows_per_entry: output rows one entry of dim 0 covers (1: the weight, a bias or per-channel
    scales; block_n: block scales). cols_per_entry: input columns one entry of dim 1 covers, 0
    where dim 1 is not split (per-channel scales [N, 1]). per_shard: one scalar per merged
    checkpoint tensor (per-tensor scales), dim 0 indexing the shard."""

    rows_per_entry: int = 1
    cols_per_entry: int = 1
    per_shard: bool = False


def new_parameter(shape: tuple[int, ...], dtype: torch.dtype | None, layout: ScaleLayout | None = None) -> nn.Parameter:
    """An uninitialized frozen parameter; `layout` tells the layer's loader how to slice it."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    if layout is not None:
        param.scale_layout = layout
    return param


class LinearMethod(ABC):
    """How one linear layer holds its weight and multiplies by it."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, shape: LinearShape) -> None:
        """Register `weight` and any scales on `layer` (the layer adds the bias)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Convert the loaded parameters into the kernel's form (quantize, merge scales)."""
        del layer

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [T, input_size] -> [T, output_size] in x's dtype."""


class UnquantizedLinearMethod(LinearMethod):
    """The weight [N, K] in the model dtype, multiplied by `ops.linear` (batch-invariantly if built so)."""

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def create_weights(self, layer: nn.Module, shape: LinearShape) -> None:
        layer.register_parameter("weight", new_parameter((shape.output_size, shape.input_size), None))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return ops.linear(x, layer.weight, bias, batch_invariant=self.batch_invariant)


class QuantizationConfig(ABC):
    """A checkpoint's (or a load-time) quantization: the methods its layers use."""

    name: str

    @abstractmethod
    def linear_method(self) -> LinearMethod:
        """A fresh method for one linear layer."""

    def moe_method(self) -> FusedMoEMethod | None:
        """A method for one mixture-of-experts layer's experts; None: unquantized experts."""
        return None

    def vocab_blocks_type(self, lm_head: bool) -> int | None:
        """The ggml type of the GGUF blocks the token embedding (`lm_head`: the LM head) keeps
        instead of a weight in the model dtype; None: the weight."""
        del lm_head
        return None


_building: list[QuantizationConfig | None] = [None]


@contextmanager
def building_with(config: QuantizationConfig | None) -> Iterator[None]:
    """Layers built inside take their methods from `config` (None: unquantized)."""
    _building.append(config)
    try:
        yield
    finally:
        _building.pop()


def current_linear_method() -> LinearMethod:
    """The method for a linear layer being built now."""
    config = _building[-1]
    return UnquantizedLinearMethod(batch_invariant_now()) if config is None else config.linear_method()


def current_moe_method() -> FusedMoEMethod | None:
    """The experts' method for a mixture-of-experts layer being built now (None: unquantized)."""
    config = _building[-1]
    return None if config is None else config.moe_method()


def current_vocab_blocks_type(lm_head: bool) -> int | None:
    """`vocab_blocks_type` of the configuration in effect, for an embedding or LM head being built."""
    config = _building[-1]
    return None if config is None else config.vocab_blocks_type(lm_head)


def process_weights_after_loading(model: nn.Module) -> None:
    """Let every layer with quantizable weights (linear layers, experts) convert them, once,
    after loading."""
    for module in model.modules():
        hook = getattr(module, "process_weights_after_loading", None)
        if callable(hook):
            hook()
