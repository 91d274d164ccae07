"""The Mamba-2 Triton kernels (conv1d, chunked scan, decode step) against the torch reference
(`ops_ref`: the conv as shifted products and a sequential scan) over shapes and batches: rows with and without a
state to continue, prefill chunks longer than a scan chunk beside one-token decodes, empty
(padding) rows, states at scattered block indices. On the CPU under TRITON_INTERPRET=1 (small
shapes), on the GPU for real (`-m gpu`: the same cases and a Mamba2-2.7B layer's shape in bf16)."""

from __future__ import annotations

import os

import pytest
import torch

from pagoda.model.layers.mamba.ops_ref import causal_conv1d_ref, ssm_scan_ref

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if not INTERPRET:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    return "cpu"


def _batch(query_lens: list[int], live: list[bool], device: str, num_blocks: int):
    """query_start_loc, the blocks read and written (scattered, distinct; odd rows move to another
    block, as a step that starts a checkpoint block does) and has_initial_state of a batch."""
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    generator = torch.Generator().manual_seed(len(query_lens))
    blocks = torch.randperm(num_blocks - 1, generator=generator)[: 2 * len(query_lens)].to(torch.int32) + 1
    written = blocks[: len(query_lens)]
    read = torch.where(torch.arange(len(query_lens)) % 2 == 1, blocks[len(query_lens) :], written)
    return starts.to(device), read.to(device), written.to(device), torch.tensor(live, device=device)


# (query lens, has state): prefills longer than a scan chunk (32) and a conv span (64), decodes,
# an empty padding row, a row of fewer tokens than the conv's history.
BATCHES = [
    ([1, 1, 1], [True, False, True]),
    ([40, 1, 0, 2], [False, True, False, True]),
    ([130], [True]),
]


@pytest.mark.parametrize("query_lens,live", BATCHES)
@pytest.mark.parametrize("kernel", [4, 3])
def test_causal_conv1d_matches_reference(query_lens, live, kernel) -> None:
    from pagoda.model.ops.triton_mamba import causal_conv1d

    device = _device()
    torch.manual_seed(0)
    dim, num_blocks = 48, 12
    x_full = torch.randn(sum(query_lens), dim + 16, device=device)
    x = x_full[:, 8 : 8 + dim]  # a strided view, as the split of in_proj's output is
    weight = torch.randn(dim, kernel, device=device)
    bias = torch.randn(dim, device=device)
    states = torch.randn(num_blocks, dim, kernel - 1, device=device)
    rows = _batch(query_lens, live, device, num_blocks)
    ref_states = states.cpu().clone()
    expected = causal_conv1d_ref(x.cpu(), weight.cpu(), bias.cpu(), ref_states, *[r.cpu() for r in rows])
    out = causal_conv1d(x, weight, bias, states, *rows, decode=max(query_lens) == 1)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states.cpu(), ref_states, atol=1e-6, rtol=0)


def _ssm_inputs(query_lens, heads, head_dim, groups, state_size, num_blocks, device, dtype=torch.float32):
    torch.manual_seed(1)
    num_tokens = sum(query_lens)
    x = torch.randn(num_tokens, heads, head_dim, device=device, dtype=dtype)
    dt = torch.randn(num_tokens, heads, device=device, dtype=dtype)
    dt_bias = torch.rand(heads, device=device) - 1.0
    A_log = torch.rand(heads, device=device) * 2 - 1.5
    B = torch.randn(num_tokens, groups, state_size, device=device, dtype=dtype)
    C = torch.randn(num_tokens, groups, state_size, device=device, dtype=dtype)
    D = torch.randn(heads, device=device)
    states = torch.randn(num_blocks, heads, head_dim, state_size, device=device, dtype=dtype)
    return x, dt, dt_bias, A_log, B, C, D, states


def _check_scan(query_lens, live, heads, head_dim, groups, state_size, decode, dtype=torch.float32, atol=1e-4):
    from pagoda.model.ops.triton_mamba import ssm_scan

    device = _device()
    num_blocks = 2 * len(query_lens) + 2
    x, dt, dt_bias, A_log, B, C, D, states = _ssm_inputs(
        query_lens, heads, head_dim, groups, state_size, num_blocks, device, dtype
    )
    rows = _batch(query_lens, live, device, num_blocks)
    ref_states = states.float().cpu().clone()
    dt_ref = torch.nn.functional.softplus(dt.float().cpu() + dt_bias.cpu())
    cpu = [t.float().cpu() for t in (x, dt_ref, -torch.exp(A_log), B, C, D)]
    expected = ssm_scan_ref(*cpu, ref_states, *[r.cpu() for r in rows])
    y = ssm_scan(x, dt, dt_bias, A_log, B, C, D, states, *rows, decode=decode)
    torch.testing.assert_close(y.float().cpu(), expected, atol=atol, rtol=atol)
    torch.testing.assert_close(states.float().cpu(), ref_states, atol=atol, rtol=atol)


@pytest.mark.parametrize("query_lens,live", BATCHES)
def test_chunked_scan_matches_sequential_reference(query_lens, live) -> None:
    _check_scan(query_lens, live, heads=4, head_dim=16, groups=2, state_size=16, decode=False)


def test_chunked_scan_odd_sizes() -> None:
    """head_dim and state_size that are not powers of two (masked tiles), one group."""
    _check_scan([33, 5], [True, False], heads=2, head_dim=24, groups=1, state_size=20, decode=False)


def test_decode_step_matches_sequential_reference() -> None:
    _check_scan([1, 0, 1, 1], [True, False, False, True], heads=4, head_dim=16, groups=2, state_size=16, decode=True)


@pytest.mark.gpu
def test_kernels_at_mamba2_2_7b_shape_bf16() -> None:
    """One Mamba2-2.7B layer's scan (80 heads of 64, state 128, one group) in bf16: a 300-token
    prefill beside decodes, then a decode batch."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check_scan(
        [300, 1, 1, 64], [False, True, True, True], 80, 64, 1, 128, decode=False, dtype=torch.bfloat16, atol=5e-2
    )
    _check_scan([1] * 8, [True] * 8, 80, 64, 1, 128, decode=True, dtype=torch.bfloat16, atol=5e-2)


@pytest.mark.parametrize("dtype,group_size", [(torch.float32, 24), (torch.bfloat16, 32)])
def test_gated_rms_norm_matches_reference(dtype, group_size) -> None:
    from pagoda.model.layers.mamba.mixer import gated_rms_norm as reference
    from pagoda.model.ops.triton_mamba import gated_rms_norm

    device = _device()
    torch.manual_seed(2)
    y = torch.randn(5, 3 * group_size, device=device, dtype=dtype)
    z_full = torch.randn(5, 4 * group_size, device=device, dtype=dtype)
    z = z_full[:, group_size:]  # strided, as the gate's split is
    weight = torch.rand(3 * group_size, device=device, dtype=dtype) + 0.5
    expected = reference(y.cpu(), z.cpu(), weight.cpu(), group_size, 1e-5)
    tolerance = 1e-5 if dtype == torch.float32 else 2**-5  # bf16: a rounding step of values near 2-4
    torch.testing.assert_close(
        gated_rms_norm(y, z, weight, group_size, 1e-5).cpu(), expected, atol=tolerance, rtol=tolerance
    )
