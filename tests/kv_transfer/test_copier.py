"""`BlockCopier`: blocks go to the host block-major (one contiguous run per block across all
layers) and come back bit-exact, into other device blocks; on the CPU and on CUDA."""

from __future__ import annotations

import pytest
import torch

from pagoda.kv_transfer.offload.copier import BlockCopier, slot_runs

NUM_TENSORS, NUM_BLOCKS, PAGE = 3, 10, 48


def test_slot_runs() -> None:
    assert list(slot_runs([4, 5, 6, 9, 2, 3])) == [(4, 0, 3), (9, 3, 1), (2, 4, 2)]
    assert list(slot_runs([])) == []


def caches(device: torch.device) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randint(0, 256, (2, NUM_BLOCKS, PAGE // 2), dtype=torch.uint8, generator=generator).to(device)
        for _ in range(NUM_TENSORS)
    ]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)], ids=["cpu", "cuda"])
def test_round_trip(device: str, monkeypatch) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # Two blocks of staging on CUDA, so that copies run in chunks and in runs of slots.
    monkeypatch.setattr("pagoda.kv_transfer.offload.copier.STAGING_BYTES", 2 * NUM_TENSORS * PAGE)
    device = torch.device(device)
    copier = BlockCopier(NUM_TENSORS, PAGE, num_host_blocks=8, device=device)
    assert copier.host.is_pinned() == (device.type == "cuda")  # registered: copies are truly asynchronous
    data = caches(device)
    original = [cache.clone() for cache in data]
    copier.bind(data)
    copier.save([3, 1, 7], [5, 6, 0])
    if device.type == "cuda":
        torch.cuda.synchronize()
    # Block-major: host slot 5 holds block 3 of every tensor, K half then V half.
    expected = torch.stack([cache[:, 3].cpu() for cache in original])
    assert torch.equal(copier.host[5], expected)
    copier.scribble([2, 4, 8])
    assert all(bool((cache[:, [2, 4, 8]] == 0xFF).all()) for cache in data)
    copier.load([5, 6, 0], [2, 4, 8])
    if device.type == "cuda":
        torch.cuda.synchronize()
    for cache, before in zip(data, original, strict=True):
        assert torch.equal(cache[:, [2, 4, 8]], before[:, [3, 1, 7]])
        untouched = [0, 1, 3, 5, 6, 7, 9]
        assert torch.equal(cache[:, untouched], before[:, untouched])


def test_bind_checks_the_layout() -> None:
    copier = BlockCopier(NUM_TENSORS, PAGE, num_host_blocks=2, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="do not match host blocks"):
        copier.bind(caches(torch.device("cpu"))[:2])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)], ids=["cpu", "cuda"])
def test_many_blocks_come_back_bit_exact_through_the_pipeline(device: str, monkeypatch) -> None:
    """40 blocks of 8 tensors through chunks of 3 (two staging buffers of 3 blocks, reused
    13 times each), from and to scattered slots and blocks: what comes back is what was saved."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    num_tensors, num_blocks, page = 8, 48, 64
    monkeypatch.setattr("pagoda.kv_transfer.offload.copier.STAGING_BYTES", 6 * num_tensors * page)
    device = torch.device(device)
    generator = torch.Generator().manual_seed(1)
    data = [
        torch.randint(0, 256, (2, num_blocks, page // 2), dtype=torch.uint8, generator=generator).to(device)
        for _ in range(num_tensors)
    ]
    original = [cache.clone() for cache in data]
    copier = BlockCopier(num_tensors, page, num_host_blocks=64, device=device)
    assert copier.chunk_blocks == 3
    copier.bind(data)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    sources, targets = order[:40], order[40:] + order[:32]  # targets overlap the sources
    slots = [s for run in (range(50, 64), range(0, 10), range(20, 36)) for s in run]
    if device.type == "cuda":
        # The copies wait for what the caller's stream queued before them: a late write of block 0.
        torch.cuda._sleep(20_000_000)
        for cache in data:
            cache[:, sources[0]] = 7
        for cache in original:
            cache[:, sources[0]] = 7
    copier.save(sources, slots)
    copier.scribble(targets)
    copier.load(slots, targets)
    if device.type == "cuda":
        torch.cuda.synchronize()
    for cache, before in zip(data, original, strict=True):
        assert torch.equal(cache[:, targets], before[:, sources])
    expected = torch.stack([torch.stack([cache[:, b].cpu() for cache in original]) for b in sources])
    assert torch.equal(copier.host[slots], expected)
