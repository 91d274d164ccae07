"""`triton_gemv.batch_invariant_linear`, the batch-invariant mode's GEMM, and `ops.linear`'s
dispatch to it: a row's output is bit-identical (torch.equal) whatever the other rows and their
count, and close to F.linear.

Without CUDA the kernel runs under TRITON_INTERPRET=1 (conftest.py) on small shapes whose
configs still split K, so that the split sums are part of what must not move with M. The
sensitivity test shows the comparison sees the last bit: the same rows under another split of K
differ. The interpreter's K steps are float32 products summed in K order (numpy's matmul sums
in an order that follows the tile's width), so on the CPU these tests check the launch: token
tiles, fused or separate splits, padding; that the GPU's mma reduces a token's column the same
whatever the tile's width is what the `gpu`-marked tests check, on the Qwen3-0.6B and
Llama-3.1-8B shapes in bf16 on the device.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")  # conftest.py turns on its interpreter when there is no GPU

from pagoda.model import ops
from pagoda.model.ops.triton_gemv import (
    COMPUTE_TILES,
    DEFAULT_NUM_SMS,
    MAX_TOKENS,
    GemvConfig,
    LaunchTiling,
    batch_invariant_linear,
    invariant_config,
    launch_change_points,
    launch_tiling,
    tiling_candidates,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Token counts around the MAX_TOKENS-row tiles: one row, a partial tile, whole tiles, a ragged tail.
TOKEN_COUNTS = (1, 3, MAX_TOKENS, MAX_TOKENS + 1, 3 * MAX_TOKENS + 5)
# Small blocks, so the interpreter's shapes take several K steps and two splits of them.
SPLIT_CONFIG = GemvConfig(block_n=16, block_k=32, split_k=2, num_warps=4, num_stages=2)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# Batch sizes a probe row must give the same bits in: below, at and past the 16-row tile, and
# across every wide token tile.
BATCH_SIZES = (1, 7, 16, 17, 64, 100, 256)


def operands(n: int, k: int, m: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=generator).to(DEVICE, dtype) if bias else None
    return x, weight, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_rows_do_not_depend_on_their_batch(dtype: torch.dtype, bias: bool) -> None:
    """Row i of a batch of M rows, for every M, equals row i computed alone, to the bit; the
    same rows among different companions, in another order, too."""
    n, k = 40, 160
    probe, weight, b = operands(n, k, 4, dtype, bias)
    alone = torch.cat([batch_invariant_linear(probe[i : i + 1], weight, b, SPLIT_CONFIG) for i in range(4)])
    torch.testing.assert_close(
        alone.float(),
        F.linear(probe.float(), weight.float(), None if b is None else b.float()),
        atol=TOLERANCE[dtype],
        rtol=TOLERANCE[dtype],
    )
    for m in TOKEN_COUNTS:
        companions, _, _ = operands(n, k, m, dtype, bias, seed=m)
        rows = torch.randperm(m + 4, generator=torch.Generator().manual_seed(m))
        batch = torch.cat([companions, probe])[rows]
        out = batch_invariant_linear(batch, weight, b, SPLIT_CONFIG)
        where = torch.argsort(rows)[m:]  # the probe rows' places in the shuffled batch
        assert torch.equal(out[where], alone), m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_keeps_its_bits_at_every_batch_size(dtype: torch.dtype) -> None:
    """One row placed at a random position among M - 1 others, for each M of BATCH_SIZES (so
    in each width of token tile the rule picks), gives the bits it gives alone; and matches
    F.linear in float32 within the dtype's rounding."""
    n, k = 40, 160
    probe, weight, b = operands(n, k, 1, dtype, bias=True)
    alone = batch_invariant_linear(probe, weight, b)
    torch.testing.assert_close(
        alone.float(), F.linear(probe.float(), weight.float(), b.float()), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )
    generator = torch.Generator().manual_seed(1)
    for m in BATCH_SIZES:
        batch, _, _ = operands(n, k, m, dtype, bias=False, seed=m)
        where = int(torch.randint(m, (1,), generator=generator))
        batch[where] = probe[0]
        out = batch_invariant_linear(batch, weight, b)
        assert torch.equal(out[where : where + 1], alone), m
        torch.testing.assert_close(
            out.float(),
            F.linear(batch.float(), weight.float(), b.float()),
            atol=TOLERANCE[dtype],
            rtol=TOLERANCE[dtype],
        )


def test_launch_tilings_do_not_change_the_bits() -> None:
    """Every launch the rule can pick (token tiles of 16 to 256 rows, W tiles of 16 to 128 rows,
    shorter K steps than the config's, the splits of K in their own programs or run in turn in
    one program) gives the bits of 16-row tiles, with a ragged K tail. Three splits, so that the
    order they are summed in shows, and float32 outputs, so that no rounding to 16 bits hides it."""
    config = GemvConfig(block_n=16, block_k=32, split_k=3, num_warps=4, num_stages=2)
    x, weight, b = operands(40, 150, 140, torch.float32, bias=True)
    reference = batch_invariant_linear(x, weight, b, config, LaunchTiling.of(config))
    candidates = tiling_candidates(config, x.element_size())
    assert {tiling.block_m for tiling in candidates} == {16, 32, 64, 128, 256}
    assert any(tiling.fuse_splits for tiling in candidates)
    for tiling in candidates:
        assert torch.equal(batch_invariant_linear(x, weight, b, config, tiling), reference), tiling


def test_launch_tiling_rule() -> None:
    """Up to 16 tokens the decode launch; the config's streaming tile while W's read bounds the
    call; then the widest compute tile that still gives every SM a program, splits fused once
    the unsplit programs fill the SMs; K steps that divide the splits; stages that fit."""
    config = GemvConfig(block_n=64, block_k=256, split_k=4, num_warps=4, num_stages=5)
    assert launch_tiling(16, 1024, 2048, config, 2, num_sms=132) == LaunchTiling.of(config)
    streaming = launch_tiling(17, 1024, 2048, config, 2, num_sms=132)
    assert (streaming.block_m, streaming.block_n, streaming.block_k, streaming.num_stages) == (
        32,
        64,
        256,
        4,
    )  # 4 x 48 KiB
    assert launch_tiling(100, 1024, 4096, config, 2, num_sms=132).block_m == 64  # long K: still streaming
    # 1024 rows, 4 splits: only 64 x 64 tiles give 132 programs at 256 tokens; at 8192 tokens the
    # widest does, and its 8 x 32 unsplit programs fill the SMs, so the splits are fused.
    assert launch_tiling(256, 1024, 2048, config, 2, num_sms=132) == replace(COMPUTE_TILES[-1], fuse_splits=False)
    assert launch_tiling(8192, 1024, 2048, config, 2, num_sms=132) == replace(COMPUTE_TILES[0], fuse_splits=True)
    assert launch_tiling(256, 151936, 1024, config, 2, num_sms=132).block_m == 256  # a vocabulary's rows
    assert launch_tiling(100, 151936, 1024, config, 2, num_sms=132).block_m == 128  # no wider than M
    small_k = GemvConfig(block_n=64, block_k=32, split_k=1)
    assert launch_tiling(512, 4096, 32, small_k, 2, num_sms=132).block_k == 32
    narrow = GemvConfig(block_n=16, block_k=128, split_k=1)  # mma.sync on Hopper: keeps its tile
    assert launch_tiling(512, 4096, 1024, narrow, 2, num_sms=132) == LaunchTiling(64, 16, 128, 4, 4)
    fp32 = launch_tiling(4096, 151936, 1024, config, 4, num_sms=132)
    assert (fp32.block_n + fp32.block_m) * fp32.block_k * 4 * fp32.num_stages <= 192 * 1024
    with pytest.raises(ValueError, match="block_m"):
        LaunchTiling(24, 64, 64, 4, 2)


def test_launch_change_points_cover_every_launch() -> None:
    """A warm-up at the change points runs every launch of 1..max_m rows: each point starts a
    new launch, and every count between two points takes the earlier one's."""
    n, k, dtype, device = 151936, 1024, torch.bfloat16, torch.device(DEVICE)
    config = invariant_config(n, k, dtype, device)
    points = launch_change_points(n, k, dtype, device, 2048)
    assert points[:2] == [1, MAX_TOKENS + 1]
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if DEVICE == "cuda" else DEFAULT_NUM_SMS
    launches = [launch_tiling(m, n, k, config, 2, num_sms) for m in range(1, 2049)]
    assert len(set(launches)) == len(points)
    assert all(launches[m - 1] == launches[max(p for p in points if p <= m) - 1] for m in range(1, 2049))


def test_another_split_of_k_changes_the_bits() -> None:
    """What the invariance rests on: the order of the K reduction shows in the last bits, so a
    GEMM whose split followed M would fail the test above."""
    x, weight, _ = operands(40, 160, MAX_TOKENS, torch.float32, bias=False)
    two_splits = batch_invariant_linear(x, weight, None, SPLIT_CONFIG)
    one_split = batch_invariant_linear(x, weight, None, GemvConfig(block_n=16, block_k=32, split_k=1))
    torch.testing.assert_close(two_splits, one_split, atol=1e-5, rtol=1e-5)
    assert not torch.equal(two_splits, one_split)


def test_invariant_config_has_no_token_count() -> None:
    """One config per weight shape: the single-token tuned entry where the table has one (so batch-1
    decode runs as fast as the tuned GEMV), else the heuristic."""
    device = torch.device(DEVICE)
    assert invariant_config(4096, 14336, torch.bfloat16, device) == GemvConfig(
        block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=5
    )
    assert invariant_config(1000, 300, torch.float32, device).block_k == 128


def test_ops_linear_dispatches_every_batch_size() -> None:
    """ops.linear(batch_invariant=True) sends every token count (and leading dims) to the kernel where
    Triton runs; it matches batch_invariant_linear to the bit."""
    x, weight, b = operands(24, 64, 2 * MAX_TOKENS + 3, torch.float32, bias=True)
    expected = batch_invariant_linear(x, weight, b)
    out = ops.linear(x.view(5, 7, 64), weight, b, batch_invariant=True)
    assert out.shape == (5, 7, 24)
    assert torch.equal(out.view(-1, 24), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (6144, 4096), (4096, 14336)])
def test_model_shapes_on_the_gpu(shape: tuple[int, int]) -> None:
    """bf16 on the device: rows among 1..512 companions equal the row alone to the bit."""
    n, k = shape
    probe, weight, _ = operands(n, k, 2, torch.bfloat16, bias=False)
    alone = batch_invariant_linear(probe, weight)
    torch.testing.assert_close(alone.float(), F.linear(probe, weight).float(), atol=2e-2, rtol=2e-2)
    for m in (1, 7, 16, 33, 256, 512, 4093):
        companions, _, _ = operands(n, k, m, torch.bfloat16, bias=False, seed=m)
        out = batch_invariant_linear(torch.cat([companions, probe]), weight)
        assert torch.equal(out[m:], alone), m


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "shape", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024), (6144, 4096), (4096, 14336)]
)
def test_launch_tilings_on_the_gpu(shape: tuple[int, int]) -> None:
    """bf16 on the device: every launch the rule can pick (the mma's N and M widths, K steps,
    warps, splits fused or not) gives the bits of 16-row tiles; what makes a row's bits the same
    at every batch size."""
    n, k = shape
    x, weight, _ = operands(n, k, 300, torch.bfloat16, bias=False)
    config = invariant_config(n, k, torch.bfloat16, x.device)
    reference = torch.cat([batch_invariant_linear(rows, weight) for rows in x.split(MAX_TOKENS)])
    for tiling in tiling_candidates(config, x.element_size()):
        assert torch.equal(batch_invariant_linear(x, weight, tiling=tiling), reference), tiling
