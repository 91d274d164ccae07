"""The torch reference of a Mamba-2 layer's recurrent ops over a flat batch of requests.

Tokens of many requests are concatenated ([T, ...]); request r owns tokens
query_start_loc[r]:query_start_loc[r + 1]; its state is read at index initial_state_indices[r]
of the state tensors when has_initial_state[r] (else zeros) and written after its last token at
state_indices[r] (the same block, or the next checkpoint's). The SSM is a plain sequential scan, one token after another (the definition the chunked
Triton kernel must reproduce), in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _rows(
    query_start_loc: torch.Tensor,
    initial_state_indices: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
):
    """(start, end, index read, index written, has state) of each non-empty row, on the host."""
    starts = query_start_loc.tolist()
    rows = zip(initial_state_indices.tolist(), state_indices.tolist(), has_initial_state.tolist(), strict=True)
    for row, (read, write, live) in enumerate(rows):
        start, end = starts[row], starts[row + 1]
        if end > start:
            yield start, end, read, write, live


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    initial_state_indices: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """SiLU(causal depthwise conv) of x [T, D] by weight [D, K]; conv_states [blocks, D, K - 1]
    hold each request's last K - 1 inputs (read and written as the rows say)."""
    width = weight.shape[1] - 1
    out = torch.zeros_like(x)
    rows = _rows(query_start_loc, initial_state_indices, state_indices, has_initial_state)
    for start, end, read, write, live in rows:
        history = conv_states[read] if live else x.new_zeros(x.shape[1], width).to(conv_states.dtype)
        extended = torch.cat([history.to(weight.dtype), x[start:end].t().to(weight.dtype)], dim=1)
        # y[:, t] = sum_k weight[:, k] * extended[:, t + k]: the conv as K shifted products.
        y = sum(weight[:, k, None] * extended[:, k : k + end - start] for k in range(weight.shape[1]))
        if bias is not None:
            y = y + bias[:, None]
        conv_states[write] = extended[:, extended.shape[1] - width :].to(conv_states.dtype)
        out[start:end] = F.silu(y).t().to(x.dtype)
    return out


def ssm_scan_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    initial_state_indices: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """y [T, H, P] of the selective scan h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,
    y_t = h_t C_t + D x_t, for x [T, H, P], dt [T, H] (already softplus'd), A, D [H], B, C [T, G, N];
    ssm_states [blocks, H, P, N] are read and written as the rows say."""
    num_heads = x.shape[1]
    heads_per_group = num_heads // B.shape[1]
    y = torch.zeros_like(x)
    A, D = A.float(), D.float()
    rows = _rows(query_start_loc, initial_state_indices, state_indices, has_initial_state)
    for start, end, read, write, live in rows:
        state = ssm_states[read].float() if live else x.new_zeros(ssm_states.shape[1:], dtype=torch.float32)
        xs, dts = x[start:end].float(), dt[start:end].float()
        Bs = B[start:end].float().repeat_interleave(heads_per_group, dim=1)
        Cs = C[start:end].float().repeat_interleave(heads_per_group, dim=1)
        for t in range(end - start):
            decay = torch.exp(dts[t] * A)[:, None, None]
            state = state * decay + (dts[t][:, None] * xs[t])[:, :, None] * Bs[t][:, None, :]
            y[start + t] = ((state * Cs[t][:, None, :]).sum(-1) + D[:, None] * xs[t]).to(x.dtype)
        ssm_states[write] = state.to(ssm_states.dtype)
    return y
