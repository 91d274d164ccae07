"""FP8 (e4m3) quantization and the FP8 linear, with the kernel chosen per call.

On CUDA a linear with per-channel weight scales runs, by token count, either a Triton
weight-only kernel (x stays in the activation dtype; decode-sized batches, where reading W is
the cost: `row_gemv` for one token, `fp8_gemv` for up to 16) or per-token dynamic
quantization + `torch._scaled_mm` (rowwise scales, cuBLASLt's FP8 tensor cores); block-wise
weights run the Triton block-scaled kernel, x quantized per token and K-group for
prefill-sized batches. `benchmarks/fp8_gemm.py` measures each choice per shape so that
`WEIGHT_ONLY_MAX_TOKENS` can be set from measurements.

Elsewhere (the CPU) the same numerics run in torch ops: x quantized to FP8 and back as the
GPU's W8A8 path does, the weight dequantized, the product in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.model import ops

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
MIN_SCALE = 1e-12
# Up to this many tokens (at most triton_fp8_gemm.GEMV_MAX_TOKENS) the weight-only Triton GEMV
# runs instead of quantizing x.
WEIGHT_ONLY_MAX_TOKENS = 16
# A single token runs the tensor-core-free `row_gemv` rather than `fp8_gemv`'s 16-row dots.
ROW_GEMV = True
# torch._scaled_mm needs K and N to be multiples of 16.
SCALED_MM_ALIGNMENT = 16
# cuBLASLt's fast FP8 accumulation (fewer promotions to float32 along K): faster, less exact;
# benchmarks/fp8_gemm.py times both.
SCALED_MM_FAST_ACCUM = False

if ops.TRITON_AVAILABLE:
    from pagoda.model.ops.triton_fp8_gemm import GEMV_MAX_TOKENS, fp8_gemm, fp8_gemv, quantize_rows
    from pagoda.model.ops.triton_row_gemv import row_gemv


def fp8_supported(device: torch.device) -> bool:
    """Whether `device` runs the FP8 kernels: the CPU (reference path) or CUDA sm_89 and newer."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (float8 [N, K], float32 scales [N]): each row scaled to FP8's range."""
    scale = (weight.float().abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    return _to_fp8(weight, scale[:, None]), scale


def quantize_blocks(weight: torch.Tensor, block_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (float8 [N, K], float32 scales [ceil(N / bn), ceil(K / bk)]) per block."""
    bn, bk = block_size
    n, k = weight.shape
    padded = F.pad(weight.float(), (0, -k % bk, 0, -n % bn))
    blocks = padded.unflatten(0, (-1, bn)).unflatten(2, (-1, bk))
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=MIN_SCALE)
    quantized = _to_fp8(blocks, scale[:, None, :, None]).flatten(2).flatten(0, 1)
    return quantized[:n, :k].contiguous(), scale


def expand_block_scales(scale: torch.Tensor, shape: torch.Size, block_size: tuple[int, int]) -> torch.Tensor:
    """Block scales [N / bn, K / bk] -> one scale per element [N, K]."""
    expanded = scale.repeat_interleave(block_size[0], dim=0).repeat_interleave(block_size[1], dim=1)
    return expanded[: shape[0], : shape[1]]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int] | None = None) -> torch.Tensor:
    """An FP8 weight back in float32: per-channel `scale` [N], or block-wise with `block_size`."""
    if block_size is None:
        return weight.float() * scale.float()[:, None]
    return weight.float() * expand_block_scales(scale.float(), weight.shape, block_size)


def quantize_activations(
    x: torch.Tensor, group_size: int | None = None, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8 [M, K], float32 scales): a static per-tensor scale broadcast to [M, 1],
    else dynamic scales per token [M, 1] or per token and K-group [M, K / group_size]."""
    if static_scale is not None:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
        return _to_fp8(x, scale), scale
    if ops.use_triton(x):
        return quantize_rows(x, group_size)
    groups = x.float().unflatten(1, (-1, group_size or x.shape[1]))
    scale = (groups.abs().amax(dim=2) / FP8_MAX).clamp(min=MIN_SCALE)
    return _to_fp8(groups, scale[:, :, None]).flatten(1), scale


def _reference_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_size: tuple[int, int] | None,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The W8A8 numerics in torch ops: x through FP8 and back, then a float32 product."""
    group = block_size[1] if block_size is not None else None
    x_q, x_scale = quantize_activations(x, group, input_scale)
    x_deq = (x_q.float().unflatten(1, (x_scale.shape[1], -1)) * x_scale[:, :, None]).flatten(1)
    out = F.linear(x_deq, dequantize(weight, weight_scale, block_size))
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def scaled_mm_rowwise(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    use_fast_accum: bool = SCALED_MM_FAST_ACCUM,
) -> torch.Tensor:
    """cuBLASLt's FP8 GEMM with per-row x scales [M, 1] and per-column W scales [1, N]; it
    writes bfloat16 (rowwise scaling's output type on torch 2.11), cast after where needed."""
    out = torch._scaled_mm(
        x_q,
        weight.t(),
        scale_a=x_scale,
        scale_b=weight_scale[None, :],
        out_dtype=torch.bfloat16,
        use_fast_accum=use_fast_accum,
    )
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    block_size: tuple[int, int] | None = None,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, K] (activation dtype) times the FP8 weight [N, K]^T (+ bias) -> [T, N] in x's dtype.

    weight_scale: per output channel [N] float32, or block-wise [N / bn, K / bk] with
    `block_size`. input_scale: a static per-tensor activation scale (None: dynamic)."""
    if not ops.use_triton(x):
        return _reference_linear(x, weight, weight_scale, block_size, input_scale, bias)
    if x.shape[0] == 1 and ROW_GEMV:
        return row_gemv(x, weight, weight_scale, block_size=block_size, bias=bias)
    if x.shape[0] <= min(WEIGHT_ONLY_MAX_TOKENS, GEMV_MAX_TOKENS):
        return fp8_gemv(x, weight, weight_scale, block_size=block_size, bias=bias)
    if block_size is not None:
        x_q, x_scale = quantize_activations(x, block_size[1], input_scale)
        return fp8_gemm(x_q, weight, weight_scale, x_scale=x_scale, block_size=block_size, bias=bias, out_dtype=x.dtype)
    x_q, x_scale = quantize_activations(x, None, input_scale)
    n, k = weight.shape
    if n % SCALED_MM_ALIGNMENT or k % SCALED_MM_ALIGNMENT:
        return fp8_gemm(x_q, weight, weight_scale, x_scale=x_scale, bias=bias, out_dtype=x.dtype)
    out = scaled_mm_rowwise(x_q, x_scale, weight, weight_scale, x.dtype)
    return out if bias is None else out + bias
