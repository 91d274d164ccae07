"""Which captured graph a batch replays: its kind (uniform decode or mixed) and padded size."""

from __future__ import annotations

import pytest

from pagoda.worker.cuda_graph import BatchDescriptor, CudaGraphManager, default_capture_sizes


def test_default_sizes_are_dense_at_small_batches() -> None:
    assert default_capture_sizes(40) == [1, 2, 4, 8, 16, 32]
    assert default_capture_sizes(512)[-1] == 512


def test_decode_graphs_stop_at_max_num_seqs_and_mixed_graphs_start_at_two() -> None:
    manager = CudaGraphManager([1, 2, 4, 8, 16, 32, 64], max_decode_size=16, max_mixed_size=64)
    assert manager.decode_sizes == [1, 2, 4, 8, 16]
    assert manager.mixed_sizes == [2, 4, 8, 16, 32, 64]
    keys = manager.descriptors
    assert keys[0] == BatchDescriptor(64, False)
    assert [k.num_tokens for k in keys] == sorted((k.num_tokens for k in keys), reverse=True)
    assert len(keys) == 11


@pytest.mark.parametrize(
    ("num_tokens", "uniform_decode", "expected"),
    [
        (1, True, BatchDescriptor(1, True)),
        (3, True, BatchDescriptor(4, True)),
        (16, True, BatchDescriptor(16, True)),
        (17, True, None),  # more decodes than max_num_seqs cannot happen; no graph anyway
        (3, False, BatchDescriptor(4, False)),
        (40, False, BatchDescriptor(64, False)),
        (65, False, None),  # larger than every graph: eager
    ],
)
def test_descriptor_for_picks_the_nearest_size_above(num_tokens, uniform_decode, expected) -> None:
    manager = CudaGraphManager([1, 2, 4, 8, 16, 32, 64], max_decode_size=16, max_mixed_size=64)
    assert manager.descriptor_for(num_tokens, uniform_decode) == expected


def test_sizes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        CudaGraphManager([0, 4], max_decode_size=4, max_mixed_size=4)
