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

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")  # conftest.py turns on its interpreter when there is no GPU

from pagoda.model import ops
from pagoda.model.ops.triton_gemv import (
    MAX_TOKENS,
    WIDE_TOKEN_TILES,
    GemvConfig,
    TokenTiling,
    batch_invariant_linear,
    invariant_config,
    token_tiling,
    wide_tile_stages,
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


def every_tiling(config: GemvConfig, element_size: int) -> list[TokenTiling]:
    """Each token tile width with its splits fused and separate."""
    tilings = [TokenTiling(MAX_TOKENS, fuse, config.num_stages) for fuse in (False, True)]
    for block_m in WIDE_TOKEN_TILES:
        tilings += [
            TokenTiling(block_m, fuse, wide_tile_stages(block_m, config, element_size)) for fuse in (False, True)
        ]
    return tilings


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


@pytest.mark.parametrize("bias", [False, True])
def test_token_tilings_do_not_change_the_bits(bias: bool) -> None:
    """Every token tile width, with the splits of K in their own programs (partials summed by
    the second kernel) or run in turn in one program, gives the same bits as 16-row tiles."""
    x, weight, b = operands(40, 160, 150, torch.bfloat16, bias)
    reference = batch_invariant_linear(x, weight, b, SPLIT_CONFIG, TokenTiling(MAX_TOKENS, False, 2))
    for tiling in every_tiling(SPLIT_CONFIG, x.element_size()):
        assert torch.equal(batch_invariant_linear(x, weight, b, SPLIT_CONFIG, tiling), reference), tiling


def test_token_tiling_rule() -> None:
    """Up to 16 tokens the GEMV's decode launch; above, the narrowest wide tile holding them
    (the widest past it), splits fused only once the unsplit programs fill the SMs, and the
    stages cut to the shared-memory budget."""
    config = GemvConfig(block_n=64, block_k=256, split_k=4, num_warps=4, num_stages=5)
    assert token_tiling(16, 1024, config, 2, num_sms=132) == TokenTiling(16, fuse_splits=False, num_stages=5)
    assert token_tiling(17, 1024, config, 2, num_sms=132).block_m == WIDE_TOKEN_TILES[0]
    assert token_tiling(100, 1024, config, 2, num_sms=132).block_m == 128
    # 16 row blocks x 2 token tiles: the splits keep their own programs; x 32 token tiles: fused.
    assert token_tiling(256, 1024, config, 2, num_sms=132) == TokenTiling(128, fuse_splits=False, num_stages=2)
    assert token_tiling(4096, 1024, config, 2, num_sms=132).fuse_splits
    with pytest.raises(ValueError, match="block_m"):
        TokenTiling(24, fuse_splits=False, num_stages=2)


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
def test_token_tilings_on_the_gpu(shape: tuple[int, int]) -> None:
    """bf16 on the device: every token tile width (the mma's N), splits fused or not, gives the
    bits of 16-row tiles; what makes a row's bits the same at every batch size."""
    n, k = shape
    x, weight, _ = operands(n, k, 300, torch.bfloat16, bias=False)
    config = invariant_config(n, k, torch.bfloat16, x.device)
    reference = torch.cat([batch_invariant_linear(rows, weight) for rows in x.split(MAX_TOKENS)])
    for tiling in every_tiling(config, x.element_size()):
        assert torch.equal(batch_invariant_linear(x, weight, tiling=tiling), reference), tiling
