"""Gated activation for the merged gate/up projection output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model import ops

if ops.TRITON_AVAILABLE:
    from pagoda.model.ops.triton_activation import silu_and_mul


class SiluAndMul(nn.Module):
    """[..., 2d] (gate, up) -> [..., d] silu(gate) * up; one fused Triton kernel on CUDA."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ops.use_triton(x):
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """[..., 2d] (gate, up) -> [..., d] gelu(gate) * up; `approximate` "tanh" is HF's
    `gelu_pytorch_tanh` (Gemma's), "none" the exact erf GELU."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        if approximate not in ("tanh", "none"):
            raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up
