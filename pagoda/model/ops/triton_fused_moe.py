"""The experts of a mixture-of-experts layer in Triton: tokens sorted by expert, then two grouped
GEMMs over the experts' stacked weights.

1. `moe_align_block_size`: each (token, k) pair of the routing is one row of work. Rows are
   sorted by expert and each expert's run is padded up to a multiple of BLOCK_M with a
   sentinel, so that every BLOCK_M-row block of the sorted order belongs to one expert. Two
   small kernels do it without atomics (so the order is the same every run): one counts each
   expert's rows, one per expert places its rows in token order after the padded runs of the
   experts before it.
2. `_fused_moe_kernel` with GATED: each program takes one block of sorted rows and BLOCK_N
   columns of the expert's gate and up projections (`w13` [E, 2I, H], gate rows first), keeps
   both accumulators and writes silu(gate) * up: the activation never leaves registers.
3. `_fused_moe_kernel` with MUL_ROUTED_WEIGHT: the down projection (`w2` [E, H, I]) of those
   rows, scaled by each row's routing weight, written per (token, k) row; the k rows of a
   token are then summed in float32 in a fixed order.

Block sizes come from `moe_config`, a small table by the average rows per expert (decode-sized
batches give each expert a row or two, prefill hundreds), so nothing is tuned at run time and
every launch is a fixed function of the shapes: the whole layer can be captured in a CUDA graph
(no host sync, the grid sized for the worst case and idle blocks exiting at once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Entries of the routing one program of the alignment kernels reads at a time.
ALIGN_BLOCK = 256


@dataclass(frozen=True)
class GemmConfig:
    """The tiling of one of the two grouped GEMMs."""

    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} ({value}) must be a power of two >= 16 (tl.dot's smallest tile)")
        if self.group_m < 1:
            raise ValueError(f"group_m ({self.group_m}) must be >= 1")


@dataclass(frozen=True)
class MoeConfig:
    """Rows per block (shared by both GEMMs: the alignment pads to it) and each GEMM's tiling."""

    block_m: int
    gate_up: GemmConfig
    down: GemmConfig

    def __post_init__(self) -> None:
        if self.block_m < 16 or self.block_m & (self.block_m - 1):
            raise ValueError(f"block_m ({self.block_m}) must be a power of two >= 16 (tl.dot's smallest tile)")


# (most rows per expert on average, config), first match wins: decode batches (an expert sees a
# row or two), small batches, prefill chunks. Starting points for 16-bit weights on an H200;
# `python benchmarks/moe_kernel.py --tune` sweeps the candidates per shape and prints the table.
CONFIG_TABLE: tuple[tuple[float, MoeConfig], ...] = (
    # decode: 32 gate and 32 up columns a program, so that Qwen3-30B-A3B's 8 experts x 768 columns
    # of one token are 192 programs (64 columns: 96, fewer than an H200's 132 SMs)
    (4, MoeConfig(16, GemmConfig(32, 256, 1, 4, 4), GemmConfig(64, 128, 1, 4, 4))),
    (32, MoeConfig(32, GemmConfig(64, 128, 8, 4, 4), GemmConfig(64, 128, 8, 4, 4))),
    (128, MoeConfig(64, GemmConfig(64, 64, 8, 4, 4), GemmConfig(128, 64, 8, 4, 4))),
    (float("inf"), MoeConfig(64, GemmConfig(128, 64, 8, 8, 3), GemmConfig(128, 64, 8, 4, 4))),
)


# Shared memory a program's pipeline stages may take: an H200 block gets 227 KiB.
SHARED_MEMORY_BYTES = 200 * 1024


def stages_that_fit(block_m: int, config: GemmConfig, gated: bool, element_size: int) -> int:
    """`config.num_stages`, fewer where one stage's tiles (a's rows, and W's gate and up columns)
    of `element_size`-byte elements would overflow the shared memory: the table is sized for
    16-bit weights, so float32 runs deepen nothing and fit."""
    stage_bytes = (block_m + (2 if gated else 1) * config.block_n) * config.block_k * element_size
    return max(1, min(config.num_stages, SHARED_MEMORY_BYTES // stage_bytes))


def moe_config(num_tokens: int, top_k: int, num_experts: int) -> MoeConfig:
    """The table's config for `num_tokens` tokens each routed to `top_k` of `num_experts` experts."""
    rows_per_expert = num_tokens * top_k / num_experts
    return next(config for bound, config in CONFIG_TABLE if rows_per_expert <= bound)


@triton.jit(do_not_specialize=["num_rows"])
def _count_rows_kernel(topk_ids_ptr, counts_ptr, num_rows, BLOCK: tl.constexpr):
    """Program e counts the routing entries that name expert e."""
    expert = tl.program_id(0)
    total = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(0, num_rows, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < num_rows, other=-1)
        total += (ids == expert).to(tl.int32)
    tl.store(counts_ptr + expert, tl.sum(total, axis=0))


@triton.jit(do_not_specialize=["num_rows"])
def _place_rows_kernel(
    topk_ids_ptr,
    counts_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_rows,
    num_experts,
    BLOCK_M: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program e writes expert e's rows (in routing order) at the end of the padded runs of
    experts 0..e-1, its padding (the sentinel `num_rows`), and its blocks' expert id."""
    expert = tl.program_id(0)
    experts = tl.arange(0, EXPERTS_PAD)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(experts < expert, padded, 0), axis=0)
    count = tl.sum(tl.where(experts == expert, counts, 0), axis=0)
    my_padded = tl.sum(tl.where(experts == expert, padded, 0), axis=0)
    if expert == 0:
        tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    placed = count * 0  # rows of this expert placed so far (an int32 scalar like count)
    for offset in range(0, num_rows, BLOCK):
        offs = offset + tl.arange(0, BLOCK)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < num_rows, other=-1)
        match = (ids == expert).to(tl.int32)
        rank = tl.cumsum(match, axis=0) - 1
        tl.store(sorted_ids_ptr + start + placed + rank, offs, mask=match == 1)
        placed += tl.sum(match, axis=0)
    pad = start + count + tl.arange(0, BLOCK_M)
    tl.store(sorted_ids_ptr + pad, tl.full((BLOCK_M,), 0, tl.int32) + num_rows, mask=pad < start + my_padded)
    first_block = start // BLOCK_M
    for block in range(0, my_padded // BLOCK_M, BLOCK):
        blocks = block + tl.arange(0, BLOCK)
        values = tl.full((BLOCK,), 0, tl.int32) + expert
        tl.store(expert_ids_ptr + first_block + blocks, values, mask=blocks < my_padded // BLOCK_M)


def max_padded_rows(num_rows: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the padded rows for any routing: each expert that gets rows pads its run
    by at most block_m - 1, and at most min(E, rows) experts get any."""
    return triton.cdiv(num_rows, block_m) * block_m + min(num_experts, num_rows) * block_m


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_ids, expert_ids, num_padded).

    sorted_ids [max_padded_rows]: indices into the flattened routing (row t * k + j), grouped by
    expert and each group padded to a multiple of block_m with T * k; expert_ids: the expert of
    each block of block_m sorted rows; num_padded [1]: how many sorted rows are in use (blocks
    past it are not written and must be skipped)."""
    num_rows = topk_ids.numel()
    ids = topk_ids.reshape(-1)
    if ids.dtype != torch.int32:
        ids = ids.to(torch.int32)
    capacity = max_padded_rows(num_rows, num_experts, block_m)
    device = topk_ids.device
    sorted_ids = torch.empty(capacity, dtype=torch.int32, device=device)
    expert_ids = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    _count_rows_kernel[(num_experts,)](ids, counts, num_rows, BLOCK=ALIGN_BLOCK)
    _place_rows_kernel[(num_experts,)](
        ids,
        counts,
        sorted_ids,
        expert_ids,
        num_padded,
        num_rows,
        num_experts,
        BLOCK_M=block_m,
        EXPERTS_PAD=triton.next_power_of_2(num_experts),
        BLOCK=ALIGN_BLOCK,
    )
    return sorted_ids, expert_ids, num_padded


@triton.jit(do_not_specialize=["num_rows"])
def _fused_moe_kernel(
    a_ptr,
    w_ptr,
    w_scale_ptr,
    out_ptr,
    routed_weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_rows,
    N,
    K,
    a_rows_per_token,
    stride_am,
    stride_we,
    stride_wn,
    stride_wse,
    stride_om,
    GATED: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    W_FP8: tl.constexpr,
):
    """out[row] = a[row // a_rows_per_token] @ W[expert]^T for the sorted rows of one block.

    GATED: W holds gate rows [0, N) and up rows [N, 2N); out = silu(gate) * up.
    MUL_ROUTED_WEIGHT: out is scaled by the row's routing weight.
    W_FP8: W is float8 with a float32 scale per expert and row (w_scale [E, rows]): each tile is
    converted to a's dtype for the dot, the accumulators scaled by their columns' scales."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(tl.num_programs(0), tl.cdiv(N, BLOCK_N))
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Groups of GROUP_M row blocks walk the columns together, so a weight tile is read from L2
    # by the blocks of one expert that follow each other.
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ids_ptr + offs_m)
    row_mask = rows < num_rows
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (rows // a_rows_per_token).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    # W[expert] is [rows, K] with K contiguous; the dot's right operand is its transpose.
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        up_ptrs = w_ptrs + N * stride_wn
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = k + offs_k < K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if DOT_IN_FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        elif W_FP8:
            w = w.to(a.dtype)
        acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)
        if GATED:
            up = tl.load(up_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if DOT_IN_FP32:
                up = up.to(tl.float32)
            elif W_FP8:
                up = up.to(a.dtype)
            acc_up = tl.dot(a, up, acc_up, input_precision=INPUT_PRECISION)
            up_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if W_FP8:
        scale_ptrs = w_scale_ptr + expert * stride_wse + offs_n
        acc = acc * tl.load(scale_ptrs, mask=n_mask, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(scale_ptrs + N, mask=n_mask, other=0.0)[None, :]
    if GATED:
        acc = tl.math.div_rn(acc, 1.0 + tl.exp(-acc)) * acc_up
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(routed_weights_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def _grouped_gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    routed_weights: torch.Tensor | None,
    alignment: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    a_rows_per_token: int,
    gated: bool,
    block_m: int,
    config: GemmConfig,
    weight_scale: torch.Tensor | None = None,
) -> None:
    sorted_ids, expert_ids, num_padded = alignment
    n = weight.shape[1] // 2 if gated else weight.shape[1]
    k = weight.shape[2]
    on_cpu = a.device.type == "cpu"
    # Triton's interpreter multiplies bf16 dot operands as their raw bits; in float32 the
    # products are the exact ones the GPU's tensor cores form.
    grid = (expert_ids.shape[0] * triton.cdiv(n, config.block_n),)
    _fused_moe_kernel[grid](
        a,
        weight,
        weight if weight_scale is None else weight_scale,
        out,
        out if routed_weights is None else routed_weights,
        sorted_ids,
        expert_ids,
        num_padded,
        out.shape[0],
        n,
        k,
        a_rows_per_token,
        a.stride(0),
        weight.stride(0),
        weight.stride(1),
        0 if weight_scale is None else weight_scale.stride(0),
        out.stride(0),
        GATED=gated,
        MUL_ROUTED_WEIGHT=routed_weights is not None,
        INPUT_PRECISION="ieee" if a.dtype == torch.float32 or on_cpu else "tf32",
        DOT_IN_FP32=on_cpu and a.dtype == torch.bfloat16,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        W_FP8=weight_scale is not None,
        num_warps=config.num_warps,
        num_stages=stages_that_fit(block_m, config, gated, a.element_size()),
    )


def fused_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoeConfig | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j].

    hidden_states [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_weights
    [T, k] (float32 or the model dtype) and topk_ids [T, k] (int32 or int64) from the router.
    Returns [T, H] in the dtype of hidden_states; `config` overrides `moe_config`'s choice.
    FP8 experts: w13 and w2 float8_e4m3fn with float32 scales per expert and row, w13_scale
    [E, 2I] and w2_scale [E, H] (weight-only: the activations stay in their dtype)."""
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be [tokens, hidden], got shape {tuple(hidden_states.shape)}")
    num_tokens, hidden = hidden_states.shape
    if w13.dim() != 3 or w13.shape[2] != hidden or w13.shape[1] % 2:
        raise ValueError(f"w13 {tuple(w13.shape)} must be [experts, 2 * intermediate, hidden={hidden}]")
    num_experts, intermediate = w13.shape[0], w13.shape[1] // 2
    if w2.shape != (num_experts, hidden, intermediate):
        raise ValueError(f"w2 {tuple(w2.shape)} must be [experts={num_experts}, {hidden}, {intermediate}]")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be [{num_tokens}, k]"
        )
    fp8 = w13_scale is not None
    if fp8 != (w2_scale is not None):
        raise ValueError("w13_scale and w2_scale come together (FP8 experts) or not at all")
    weight_dtype = torch.float8_e4m3fn if fp8 else hidden_states.dtype
    if hidden_states.dtype not in DTYPES or w13.dtype != weight_dtype or w2.dtype != weight_dtype:
        raise ValueError(
            f"hidden_states ({hidden_states.dtype}) must have a dtype of {DTYPES} and w13 ({w13.dtype}) and w2 "
            f"({w2.dtype}) the dtype {weight_dtype}"
        )
    if fp8 and (w13_scale.shape != w13.shape[:2] or w2_scale.shape != w2.shape[:2]):
        raise ValueError(
            f"w13_scale {tuple(w13_scale.shape)} and w2_scale {tuple(w2_scale.shape)} must be "
            f"{tuple(w13.shape[:2])} and {tuple(w2.shape[:2])} (per expert and row)"
        )
    if not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("w13 and w2 must be contiguous")
    top_k = topk_ids.shape[1]
    out = torch.empty_like(hidden_states)
    if num_tokens == 0:
        return out
    if hidden_states.stride(1) != 1:
        hidden_states = hidden_states.contiguous()
    if config is None:
        config = moe_config(num_tokens, top_k, num_experts)
    num_rows = num_tokens * top_k
    alignment = moe_align_block_size(topk_ids, num_experts, config.block_m)
    activated = torch.empty(num_rows, intermediate, dtype=hidden_states.dtype, device=hidden_states.device)
    _grouped_gemm(
        hidden_states, w13, activated, None, alignment, top_k, True, config.block_m, config.gate_up, w13_scale
    )
    per_row = torch.empty(num_rows, hidden, dtype=hidden_states.dtype, device=hidden_states.device)
    weights = topk_weights.reshape(-1).contiguous()
    _grouped_gemm(activated, w2, per_row, weights, alignment, 1, False, config.block_m, config.down, w2_scale)
    if top_k == 1:
        return per_row
    return torch.sum(per_row.view(num_tokens, top_k, hidden), dim=1, dtype=torch.float32).to(hidden_states.dtype)
