"""SiLU-and-mul on the merged gate/up projection output, in one Triton kernel.

Each program takes COLUMNS_PER_PROGRAM columns of one token's row: silu(gate) in float32 as torch
computes it (x / (1 + exp(-x)), the division correctly rounded), rounded to the model dtype,
then the product with up rounded again, as the torch path's two ops round. Only the exponential
differs from torch's (Triton's is faster and a few ulp less exact), so float32 results agree to
rounding and bf16/fp16 results nearly always bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

COLUMNS_PER_PROGRAM = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, size, BLOCK_SIZE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < size
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + token * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * stride_x + size + cols, mask=mask, other=0.0).to(tl.float32)
    silu = tl.math.div_rn(gate, 1.0 + tl.exp(-gate)).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, (silu * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * d] (gate, up) -> [..., d] silu(gate) * up."""
    if x.shape[-1] % 2:
        raise ValueError(f"the last dimension of x ({x.shape[-1]}) must be even: gate and up halves")
    size = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * size)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*x.shape[:-1], size, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0 or size == 0:
        return out
    out_rows = out.view(-1, size)
    grid = (rows.shape[0], triton.cdiv(size, COLUMNS_PER_PROGRAM))
    _silu_and_mul_kernel[grid](rows, out_rows, rows.stride(0), out_rows.stride(0), size, BLOCK_SIZE=COLUMNS_PER_PROGRAM)
    return out
