"""RMSNorm with an optional fused residual add, numerically as Hugging Face computes it.

The residual add happens in the model dtype (as HF's decoder layers do it), the normalization
in float32, and the result is cast back before the weight multiplies it. On CUDA one Triton
kernel does all of it; the torch ops here are the reference it follows.
"""

from __future__ import annotations

from typing import overload

import torch
from torch import nn

from pagoda.model import ops

if ops.TRITON_AVAILABLE:
    from pagoda.model.ops.triton_rms_norm import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalize `x`, or with `residual` given, normalize `x + residual` and also return that sum
        (the next residual)."""
        if ops.use_triton(x):
            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._normalize(x)
        x = x + residual
        return self._normalize(x), x

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.device.type == "cpu":
            # One ATen op instead of seven, bit for bit the ops below in float32 (no casts to
            # round), ~8 us less a call on the CPU, where a decode step is mostly small ops.
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored zero-centred and scales by (1 + weight), and the
    product is taken in float32 before the cast back (Llama casts first), as HF's Gemma 2 and 3 do.
    The same optional fused residual add as `RMSNorm`, in the model dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._normalize(x)
        x = x + residual
        return self._normalize(x), x

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def add_and_norm(
    norm: nn.Module, hidden_states: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm block's entry: (norm(stream), stream), the residual stream being the previous
    block's output plus its residual (the add fused into the norm), or, entering the first block
    (`residual` None), the hidden states themselves."""
    if residual is None:
        return norm(hidden_states), hidden_states
    return norm(hidden_states, residual)
