"""RMSNorm, alone or after the residual add, in one Triton kernel: one program per token row.

The arithmetic follows the torch path in `pagoda.model.layers.layernorm` step by step: the
residual add rounded to the model dtype (and written out as the next residual), the norm in
float32, the result rounded to the model dtype before the weight multiplies it. Only the order
of the float32 sum of squares (and the last bit of the rsqrt) differs, so float32 results agree
to rounding and bf16/fp16 results almost always bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_HIDDEN_SIZE = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < hidden_size
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + residual).to(dtype)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / hidden_size + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed.to(dtype).to(tl.float32) * weight).to(dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., hidden] over its last dimension, times weight [hidden]."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(_as_rows(x), None, weight, eps, out.view(-1, x.shape[-1]), None)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of x + residual, x + residual), the sum rounded to x's dtype; all [..., hidden]."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out)
    hidden_size = x.shape[-1]
    _launch(_as_rows(x), _as_rows(residual), weight, eps, out.view(-1, hidden_size), residual_out.view(-1, hidden_size))
    return out, residual_out


def _launch(
    rows: torch.Tensor,
    residual_rows: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out_rows: torch.Tensor,
    residual_out_rows: torch.Tensor | None,
) -> None:
    num_rows, hidden_size = rows.shape
    if weight.shape != (hidden_size,) or weight.dtype != rows.dtype:
        raise ValueError(
            f"weight {tuple(weight.shape)} {weight.dtype} must be (hidden_size,) = ({hidden_size},) in {rows.dtype}"
        )
    if hidden_size > MAX_HIDDEN_SIZE:
        raise ValueError(f"hidden_size {hidden_size} exceeds the kernel's limit {MAX_HIDDEN_SIZE}")
    if num_rows == 0:
        return
    block_size = triton.next_power_of_2(hidden_size)
    has_residual = residual_rows is not None and residual_out_rows is not None
    _rms_norm_kernel[(num_rows,)](
        rows,
        residual_rows if has_residual else rows,
        weight,
        out_rows,
        residual_out_rows if has_residual else out_rows,
        rows.stride(0),
        residual_rows.stride(0) if has_residual else 0,
        out_rows.stride(0),
        residual_out_rows.stride(0) if has_residual else 0,
        hidden_size,
        eps,
        HAS_RESIDUAL=has_residual,
        BLOCK_SIZE=block_size,
        num_warps=min(max(block_size // 256, 1), 8),
    )


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., hidden] as [rows, hidden] with unit stride along hidden (a view when it can be)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()
