"""Triton kernels of a Mamba-2 layer over a flat batch of requests with paged state.

Request row r owns tokens query_start_loc[r]:query_start_loc[r + 1] (rows with none, the padding
of a CUDA graph, do nothing); its state is read at index initial_state_indices[r] when
has_initial_state[r] (else taken as zeros) and written at state_indices[r]. Every loop bound comes from these device tensors, so
a graph captured on one batch replays any other of its size.

- `causal_conv1d`: depthwise causal conv + SiLU; programs per (row, channel block, split) walk
  spans of the row's tokens keeping the last K - 1 inputs in registers (K <= 4); the last K - 1
  inputs become the state.
- `ssm_scan`: the selective scan. Prefill chunks (and mixed batches) take the chunked form
  (SSD): per (row, head, head_dim block), chunks of CHUNK tokens, within a chunk
  y = ((C B^T) * exp(segsum(dt A)) * dt) x + exp(cumsum) C h, and h carried across chunks, all
  in float32. A decode batch (one token per row) takes the single-step update.
- `gated_rms_norm`: RMSNorm of y * SiLU(z) per channel group, fused (the mixer's output norm).
The torch references are `pagoda.model.layers.mamba.ops_ref` and `mixer.gated_rms_norm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_CONV_KERNEL = 4
# Tokens per chunk of the chunked scan (its intra-chunk matrices are CHUNK x CHUNK).
CHUNK = 32
# The conv walks a row in spans of CONV_SPAN tokens, CONV_SPLITS programs per row and channel
# block (a fixed count, so a captured graph replays any row lengths).
CONV_SPAN = 64
CONV_SPLITS = 16


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _load_history(x_ptr, stride_x, t, d, mask, K: tl.constexpr):
    """x[t - 3], x[t - 2], x[t - 1] (the last K - 1 of them; zeros for the rest) as float32."""
    h1 = tl.zeros(d.shape, dtype=tl.float32)
    h2 = tl.zeros(d.shape, dtype=tl.float32)
    h3 = tl.load(x_ptr + (t - 1) * stride_x + d, mask=mask, other=0.0).to(tl.float32)
    if K >= 3:
        h2 = tl.load(x_ptr + (t - 2) * stride_x + d, mask=mask, other=0.0).to(tl.float32)
    if K >= 4:
        h1 = tl.load(x_ptr + (t - 3) * stride_x + d, mask=mask, other=0.0).to(tl.float32)
    return h1, h2, h3


@triton.jit
def _causal_conv1d_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    state_ptr,
    out_ptr,
    qsl_ptr,
    read_idx_ptr,
    idx_ptr,
    live_ptr,
    stride_x,
    stride_out,
    stride_state_block,
    stride_state_dim,
    stride_read_idx,
    stride_idx,
    dim,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPAN: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    row = tl.program_id(0)
    start = tl.load(qsl_ptr + row)
    end = tl.load(qsl_ptr + row + 1)
    if end == start:
        return
    split = tl.program_id(2)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = d < dim
    live = tl.load(live_ptr + row) != 0
    read = tl.load(read_idx_ptr + row * stride_read_idx).to(tl.int64)
    state = state_ptr + read * stride_state_block + d * stride_state_dim
    # The state's inputs before the row's first token (zeros for a request's first step, whose
    # block may hold a stale state): h3 the newest, h1 the oldest (K = 4).
    s1 = tl.zeros([BLOCK_D], dtype=tl.float32)
    s2 = tl.zeros([BLOCK_D], dtype=tl.float32)
    s3 = tl.where(live, tl.load(state + (K - 2), mask=mask, other=0.0).to(tl.float32), 0.0)
    w3 = tl.load(w_ptr + d * K + (K - 1), mask=mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + d * K + (K - 2), mask=mask, other=0.0).to(tl.float32)
    w1 = tl.zeros([BLOCK_D], dtype=tl.float32)
    w0 = tl.zeros([BLOCK_D], dtype=tl.float32)
    if K >= 3:
        s2 = tl.where(live, tl.load(state + (K - 3), mask=mask, other=0.0).to(tl.float32), 0.0)
        w1 = tl.load(w_ptr + d * K + (K - 3), mask=mask, other=0.0).to(tl.float32)
    if K >= 4:
        s1 = tl.where(live, tl.load(state + (K - 4), mask=mask, other=0.0).to(tl.float32), 0.0)
        w0 = tl.load(w_ptr + d * K + (K - 4), mask=mask, other=0.0).to(tl.float32)
    bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + d, mask=mask, other=0.0).to(tl.float32)
    h1, h2, h3 = s1, s2, s3
    # Spans of SPAN tokens, span j to split j % NUM_SPLITS; each walks its tokens keeping the last
    # K - 1 inputs in registers, starting from the state (span 0) or the inputs before it.
    num_spans = tl.cdiv(end - start, SPAN)
    for span in range(split, num_spans, NUM_SPLITS):
        first = start.to(tl.int64) + span * SPAN
        if span == 0:
            h1, h2, h3 = s1, s2, s3
        else:
            h1, h2, h3 = _load_history(x_ptr, stride_x, first, d, mask, K)
        x_row = x_ptr + first * stride_x + d
        out_row = out_ptr + first * stride_out + d
        for _ in range(first, tl.minimum(first + SPAN, end)):
            x = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
            acc = bias + w0 * h1 + w1 * h2 + w2 * h3 + w3 * x
            y = acc / (1.0 + tl.exp(-acc))
            tl.store(out_row, y.to(out_ptr.dtype.element_ty), mask=mask)
            x_row += stride_x
            out_row += stride_out
            h1 = h2
            h2 = h3
            h3 = x
    # The state after the row: split 0 writes it, after its own read of the previous state
    # (the same block, unless a checkpoint starts), from its registers when the row is one span.
    if split == 0:
        if num_spans > 1:
            h1, h2, h3 = _load_history(x_ptr, stride_x, end.to(tl.int64), d, mask, K)
        dtype = state_ptr.dtype.element_ty
        index = tl.load(idx_ptr + row * stride_idx).to(tl.int64)
        state = state_ptr + index * stride_state_block + d * stride_state_dim
        tl.store(state + (K - 2), h3.to(dtype), mask=mask)
        if K >= 3:
            tl.store(state + (K - 3), h2.to(dtype), mask=mask)
        if K >= 4:
            tl.store(state + (K - 4), h1.to(dtype), mask=mask)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    initial_state_indices: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    decode: bool = False,
) -> torch.Tensor:
    """SiLU(causal conv) of x [T, D] (unit column stride) by weight [D, K]; conv_states [blocks, D,
    K - 1] (unit last stride) updated in place. Returns [T, D] contiguous, in x's dtype. `decode`:
    no row has more than one token (one program per row and channel block)."""
    num_tokens, dim = x.shape
    kernel = weight.shape[1]
    if not 2 <= kernel <= MAX_CONV_KERNEL:
        raise ValueError(f"conv_kernel must be in [2, {MAX_CONV_KERNEL}] for the Triton conv, got {kernel}")
    if x.stride(1) != 1 or conv_states.stride(2) != 1 or not weight.is_contiguous():
        raise ValueError("x and conv_states need a unit last stride and weight must be contiguous")
    out = torch.empty(num_tokens, dim, dtype=x.dtype, device=x.device)
    rows = state_indices.shape[0]
    block_d = min(256, triton.next_power_of_2(dim))
    splits = 1 if decode else CONV_SPLITS
    _causal_conv1d_kernel[(rows, triton.cdiv(dim, block_d), splits)](
        x,
        weight,
        bias if bias is not None else weight,
        conv_states,
        out,
        query_start_loc,
        initial_state_indices,
        state_indices,
        has_initial_state,
        x.stride(0),
        out.stride(0),
        conv_states.stride(0),
        conv_states.stride(1),
        initial_state_indices.stride(0),
        state_indices.stride(0),
        dim,
        K=kernel,
        HAS_BIAS=bias is not None,
        BLOCK_D=block_d,
        SPAN=CONV_SPAN,
        NUM_SPLITS=splits,
    )
    return out


@triton.jit
def _ssm_scan_kernel(
    x_ptr,
    dt_ptr,
    dt_bias_ptr,
    A_log_ptr,
    B_ptr,
    C_ptr,
    D_ptr,
    state_ptr,
    y_ptr,
    qsl_ptr,
    read_idx_ptr,
    idx_ptr,
    live_ptr,
    stride_x_t,
    stride_x_h,
    stride_dt,
    stride_b_t,
    stride_b_g,
    stride_c_t,
    stride_c_g,
    stride_s_block,
    stride_s_h,
    stride_s_p,
    stride_y_t,
    stride_y_h,
    stride_read_idx,
    stride_idx,
    head_dim,
    state_size,
    dt_min,
    dt_max,
    HEADS_PER_GROUP: tl.constexpr,
    CLAMP_DT: tl.constexpr,
    DECODE: tl.constexpr,
    PRECISION: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One (row, head, head_dim block) tile of the state: read, advanced past the row's tokens
    (`DECODE`: its one token, in one step; else chunk by chunk), written."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    start = tl.load(qsl_ptr + row)
    end = tl.load(qsl_ptr + row + 1)
    if end == start:
        return
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_mask = p < head_dim
    n_mask = n < state_size
    read = tl.load(read_idx_ptr + row * stride_read_idx).to(tl.int64)
    index = tl.load(idx_ptr + row * stride_idx).to(tl.int64)
    live = tl.load(live_ptr + row) != 0
    tile = head * stride_s_h + p[:, None] * stride_s_p + n[None, :]
    tile_mask = p_mask[:, None] & n_mask[None, :]
    state = tl.load(state_ptr + read * stride_s_block + tile, mask=tile_mask, other=0.0).to(tl.float32)
    state = tl.where(live, state, 0.0)
    A = -tl.exp(tl.load(A_log_ptr + head).to(tl.float32))
    D = tl.load(D_ptr + head).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    group = head // HEADS_PER_GROUP
    if DECODE:
        t = start.to(tl.int64)
        dt = _softplus(tl.load(dt_ptr + t * stride_dt + head).to(tl.float32) + dt_bias)
        if CLAMP_DT:
            dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        B = tl.load(B_ptr + t * stride_b_t + group * stride_b_g + n, mask=n_mask, other=0.0).to(tl.float32)
        C = tl.load(C_ptr + t * stride_c_t + group * stride_c_g + n, mask=n_mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + t * stride_x_t + head * stride_x_h + p, mask=p_mask, other=0.0).to(tl.float32)
        state = state * tl.exp(dt * A) + (dt * x)[:, None] * B[None, :]
        y = tl.sum(state * C[None, :], axis=1) + D * x
        tl.store(y_ptr + t * stride_y_t + head * stride_y_h + p, y.to(y_ptr.dtype.element_ty), mask=p_mask)
    else:
        offsets = tl.arange(0, CHUNK_SIZE)
        causal = offsets[:, None] >= offsets[None, :]
        for chunk_start in range(start, end, CHUNK_SIZE):
            tokens = chunk_start + offsets
            t_mask = tokens < end
            tokens = tokens.to(tl.int64)
            dt = _softplus(tl.load(dt_ptr + tokens * stride_dt + head, mask=t_mask, other=0.0).to(tl.float32) + dt_bias)
            if CLAMP_DT:
                dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
            dt = tl.where(t_mask, dt, 0.0)
            dA = dt * A
            cum = tl.cumsum(dA, axis=0)
            total = tl.sum(dA, axis=0)
            x = tl.load(
                x_ptr + tokens[:, None] * stride_x_t + head * stride_x_h + p[None, :],
                mask=t_mask[:, None] & p_mask[None, :],
                other=0.0,
            ).to(tl.float32)
            nm = t_mask[:, None] & n_mask[None, :]
            B = tl.load(B_ptr + tokens[:, None] * stride_b_t + group * stride_b_g + n[None, :], mask=nm, other=0.0)
            C = tl.load(C_ptr + tokens[:, None] * stride_c_t + group * stride_c_g + n[None, :], mask=nm, other=0.0)
            B = B.to(tl.float32)
            C = C.to(tl.float32)
            # Intra-chunk: token i reads token j <= i through exp(cum_i - cum_j) dt_j (C_i . B_j).
            scores = tl.dot(C, tl.trans(B), input_precision=PRECISION)
            decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
            y = tl.dot(scores * decay * dt[None, :], x, input_precision=PRECISION)
            # The state carried in, decayed to each token.
            y += tl.exp(cum)[:, None] * tl.dot(C, tl.trans(state), input_precision=PRECISION)
            y += D * x
            tl.store(
                y_ptr + tokens[:, None] * stride_y_t + head * stride_y_h + p[None, :],
                y.to(y_ptr.dtype.element_ty),
                mask=t_mask[:, None] & p_mask[None, :],
            )
            weights = tl.exp(total - cum) * dt
            state = state * tl.exp(total) + tl.dot(tl.trans(x * weights[:, None]), B, input_precision=PRECISION)
    tl.store(state_ptr + index * stride_s_block + tile, state.to(state_ptr.dtype.element_ty), mask=tile_mask)


def ssm_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    initial_state_indices: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    decode: bool = False,
    dt_limit: tuple[float, float] | None = None,
) -> torch.Tensor:
    """y [T, H, P] (x's dtype) of the selective scan with dt = softplus(dt + dt_bias) (clamped to
    `dt_limit` when given) and A = -exp(A_log): x [T, H, P], dt [T, H], B, C [T, G, N] (unit last
    strides), A_log, D, dt_bias [H]; ssm_states [blocks, H, P, N] (unit last stride) updated in place. `decode`: every
    non-empty row has exactly one token (the single-step kernel)."""
    num_tokens, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1], B.shape[2]
    for name, tensor in (("x", x), ("B", B), ("C", C), ("ssm_states", ssm_states)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} needs a unit last stride, got strides {tensor.stride()}")
    if dt.stride(1) != 1:
        raise ValueError(f"dt needs a unit last stride, got strides {dt.stride()}")
    y = torch.empty(num_tokens, num_heads, head_dim, dtype=x.dtype, device=x.device)
    rows = state_indices.shape[0]
    block_n = max(16, triton.next_power_of_2(state_size))
    low, high = dt_limit if dt_limit is not None else (0.0, float("inf"))
    # Decode tiles are a plain product, so narrow ones spread the row over more programs; the
    # chunked form's tl.dot needs tiles of at least 16.
    block_p = (
        min(16, triton.next_power_of_2(head_dim)) if decode else max(16, min(32, triton.next_power_of_2(head_dim)))
    )
    _ssm_scan_kernel[(rows, num_heads, triton.cdiv(head_dim, block_p))](
        x,
        dt,
        dt_bias,
        A_log,
        B,
        C,
        D,
        ssm_states,
        y,
        query_start_loc,
        initial_state_indices,
        state_indices,
        has_initial_state,
        x.stride(0),
        x.stride(1),
        dt.stride(0),
        B.stride(0),
        B.stride(1),
        C.stride(0),
        C.stride(1),
        ssm_states.stride(0),
        ssm_states.stride(1),
        ssm_states.stride(2),
        y.stride(0),
        y.stride(1),
        initial_state_indices.stride(0),
        state_indices.stride(0),
        head_dim,
        state_size,
        low,
        high,
        HEADS_PER_GROUP=num_heads // num_groups,
        CLAMP_DT=dt_limit is not None,
        DECODE=decode,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        CHUNK_SIZE=CHUNK,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        num_warps=4,
    )
    return y


@triton.jit
def _gated_rms_norm_kernel(
    y_ptr, z_ptr, w_ptr, out_ptr, stride_y, stride_z, stride_out, group_size, eps, BLOCK: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * group_size + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < group_size
    y = tl.load(y_ptr + token * stride_y + offsets, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + token * stride_z + offsets, mask=mask, other=0.0).to(tl.float32)
    h = y * z / (1.0 + tl.exp(-z))
    h = h * tl.rsqrt(tl.sum(h * h, axis=0) / group_size + eps)
    dtype = out_ptr.dtype.element_ty
    # As HF: the normalized value cast to the model dtype, then times the weight (in that dtype).
    w = tl.load(w_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    out = (h.to(dtype).to(tl.float32) * w).to(dtype)
    tl.store(out_ptr + token * stride_out + offsets, out, mask=mask)


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    """RMSNorm of y * SiLU(z) over groups of `group_size` channels times weight: y, z [T, C]
    (unit column stride) -> [T, C] in y's dtype; one program per (token, group)."""
    num_tokens, channels = y.shape
    if y.stride(1) != 1 or z.stride(1) != 1 or channels % group_size:
        raise ValueError(f"y, z [T, {channels}] need unit column strides and whole groups of {group_size}")
    out = torch.empty(num_tokens, channels, dtype=y.dtype, device=y.device)
    block = triton.next_power_of_2(group_size)
    _gated_rms_norm_kernel[(num_tokens, channels // group_size)](
        y,
        z,
        weight,
        out,
        y.stride(0),
        z.stride(0),
        out.stride(0),
        group_size,
        eps,
        BLOCK=block,
        num_warps=min(16, max(1, block // 512)),
    )
    return out
