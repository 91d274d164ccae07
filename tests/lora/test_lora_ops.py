"""The batched LoRA kernels (shrink over the hidden size, expand into the base output) against the
torch reference, over tokens of mixed adapters and none: on the CPU under TRITON_INTERPRET=1 at
small shapes, on the GPU (gpu) at the Llama-3.1-8B projections' shapes in bfloat16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.lora import ops
from pagoda.lora.mapping import LoRABatchIndex
from pagoda.lora.triton_ops import expand_block_n, lora_expand, lora_shrink


def _batch(num_tokens: int, max_loras: int, device: torch.device, seed: int) -> LoRABatchIndex:
    """Rows of 1-9 tokens, each with a random slot or none (-1; the first row has slot 0), then
    an eighth of `num_tokens` as padding."""
    rng = np.random.default_rng(seed)
    real = num_tokens - num_tokens // 8
    lengths: list[int] = []
    while sum(lengths) < real:
        lengths.append(min(int(rng.integers(1, 10)), real - sum(lengths)))
    slots = rng.integers(-1, max_loras, len(lengths))
    slots[0] = 0
    index = LoRABatchIndex(num_tokens, max_loras, device, pin_memory=False)
    index.set_batch(slots, np.array(lengths), num_tokens)
    return index


def _reference(x, lora_a, lora_b, slices, index):
    """The torch path's result (computed on the CPU in float32)."""
    cpu = LoRABatchIndex(x.shape[0], lora_a.shape[0], torch.device("cpu"), pin_memory=False)
    cpu.token_slots.gpu.copy_(index.token_slots.gpu.cpu())
    cpu.active_slots = index.active_slots
    y = torch.zeros(x.shape[0], lora_b.shape[1])
    h = ops.shrink(x.float().cpu(), lora_a.float().cpu(), cpu, use_triton=False)
    ops.expand(y, h, lora_b.float().cpu(), slices, cpu, use_triton=False)
    return h, y


def _check(num_tokens, in_features, out_slices, max_loras, device, dtype, atol, rtol, rank=16, seed=0):
    torch.manual_seed(seed)
    out_features = sum(out_slices)
    offsets = tuple(int(o) for o in np.cumsum((0, *out_slices[:-1])))
    slices = tuple(zip(offsets, out_slices, strict=True))
    x = torch.randn(num_tokens, in_features, device=device).to(dtype)
    lora_a = (torch.randn(max_loras, len(slices) * rank, in_features, device=device) * in_features**-0.5).to(dtype)
    lora_b = (torch.randn(max_loras, out_features, rank, device=device) * rank**-0.5).to(dtype)
    index = _batch(num_tokens, max_loras, device, seed)
    assert index.active_slots
    h = torch.zeros(num_tokens, lora_a.shape[1], dtype=torch.float32, device=device)
    lora_shrink(x, lora_a, h, index.sorted_tokens.gpu, index.tiles)
    base = torch.randn(num_tokens, out_features, device=device).to(dtype)
    y = base.clone()
    lora_expand(h, lora_b, y, offsets[1:], index.sorted_tokens.gpu, index.tiles)
    h_ref, delta_ref = _reference(x, lora_a, lora_b, slices, index)
    torch.testing.assert_close(h.cpu(), h_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close((y.float() - base.float()).cpu(), delta_ref, atol=atol * 4, rtol=rtol * 4)
    # Tokens without an adapter keep the base output exactly.
    untouched = (index.token_slots.gpu[:num_tokens] < 0).cpu()
    assert torch.equal(y.cpu()[untouched], base.cpu()[untouched])


@pytest.mark.parametrize(
    ("num_tokens", "in_features", "max_loras", "rank"),
    [(41, 1100, 3, 16), (100, 256, 2, 16), (20, 128, 2, 64)],
    ids=["split-k-ragged", "several-tiles-per-slot", "rank-64"],
)
def test_kernels_match_reference_interpreted(num_tokens, in_features, max_loras, rank) -> None:
    """q/k/v-like slices (32, 16, 16): a hidden size of 1100 is split in two K runs (atomic adds)
    with a ragged tail; 100 tokens over 2 slots make several token tiles per slot; rank 64 is
    max_lora_rank's limit."""
    cpu = torch.device("cpu")
    _check(num_tokens, in_features, (32, 16, 16), max_loras, cpu, torch.float32, atol=1e-4, rtol=1e-4, rank=rank)


def test_expand_tiles_never_straddle_slices() -> None:
    assert expand_block_n((4096, 5120)) == 64
    assert expand_block_n((96,)) == 32
    with pytest.raises(ValueError, match="multiples of 16"):
        expand_block_n((40,))


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("in_features", "out_slices"),
    [(4096, (4096, 1024, 1024)), (4096, (4096,)), (4096, (14336, 14336)), (14336, (4096,))],
    ids=["qkv", "o", "gate_up", "down"],
)
@pytest.mark.parametrize("num_tokens", [1, 256, 2048])
@pytest.mark.parametrize("rank", [16, 64])
def test_kernels_match_reference_llama8b_shapes(in_features, out_slices, num_tokens, rank) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check(
        num_tokens, in_features, out_slices, 8, torch.device("cuda"), torch.bfloat16, atol=2e-2, rtol=2e-2, rank=rank
    )
