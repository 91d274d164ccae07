"""PackedStaging: the staged prefixes of its buffers reach the device in few copies, nothing else does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.worker.cpu_gpu_buffer import _MERGE_GAP_BYTES, CpuGpuBuffer, PackedStaging

SIZES = {
    "lens": (9, torch.int32),
    "rows": (8, torch.int64),
    "ids": (100_000, torch.int64),  # 800 KB: a span after it is too far to merge with one before
    "slots": (64, torch.int64),
}


def make_staging() -> PackedStaging:
    """Merging as on a GPU (the CPU's default merges only touching spans)."""
    return PackedStaging(SIZES, torch.device("cpu"), pin_memory=False, merge_gap_bytes=_MERGE_GAP_BYTES)


def test_staged_prefixes_arrive_and_the_rest_stays() -> None:
    """Bytes between merged spans may go too (lens' tail here); far from any span nothing does."""
    staging = make_staging()
    rng = np.random.default_rng(0)
    for name, buffer in staging.buffers.items():
        assert buffer.np.dtype == np.dtype(str(SIZES[name][1]).removeprefix("torch."))
        buffer.np[:] = rng.integers(0, 1000, len(buffer.np))
    views = {name: staging.stage(staging[name], 5) for name in ("lens", "rows", "slots")}
    staging.send()
    for name, view in views.items():
        assert view.data_ptr() == staging[name].gpu.data_ptr()  # fixed addresses, as graphs read them
        assert view.tolist() == staging[name].np[:5].tolist()
    assert not staging["slots"].gpu[5:].any()  # past the last staged prefix: not sent
    assert not staging["ids"].gpu.any()  # not staged, between staged spans too far apart


@pytest.mark.parametrize(
    ("merge_gap_bytes", "copies"), [(_MERGE_GAP_BYTES, 1), (None, 2)], ids=["gpu-gap", "cpu-default"]
)
def test_close_spans_merge_only_where_a_copy_costs_a_launch(merge_gap_bytes: int | None, copies: int) -> None:
    """Spans 500 bytes apart go in one copy with a GPU's gap; on the CPU (the default there) a copy
    saves no launch, so the bytes between would be copied for nothing. Overlapping spans are one
    copy and far ones two either way."""
    staging = PackedStaging(SIZES, torch.device("cpu"), pin_memory=False, merge_gap_bytes=merge_gap_bytes)
    staging["rows"].np[:] = 7
    staging.stage(staging["lens"], 3)
    staging.stage(staging["rows"], 8)
    assert staging.send() == copies
    assert staging["rows"].gpu.tolist() == [7] * 8
    staging.stage(staging["rows"], 2)
    staging.stage(staging["rows"], 8)
    assert staging.send() == 1
    staging.stage(staging["lens"], 3)
    staging.stage(staging["slots"], 2)
    assert staging.send() == 2
    assert staging.send() == 0  # nothing staged since


def test_a_staged_buffer_is_sent_once_per_send() -> None:
    staging = make_staging()
    buffer = staging["rows"]
    buffer.np[:4] = [1, 2, 3, 4]
    staging.stage(buffer, 4)
    staging.send()
    buffer.np[:4] = [5, 6, 7, 8]
    assert buffer.gpu[:4].tolist() == [1, 2, 3, 4]  # the host's later writes wait for the next send
    staging.stage(buffer, 2)
    staging.send()
    assert buffer.gpu[:4].tolist() == [5, 6, 3, 4]


def test_a_foreign_buffer_is_refused() -> None:
    staging = make_staging()
    with pytest.raises(ValueError, match="not one of this PackedStaging"):
        staging.stage(CpuGpuBuffer(4, torch.int64, torch.device("cpu"), pin_memory=False), 4)


def test_a_negative_size_names_the_buffer() -> None:
    with pytest.raises(ValueError, match="'lens'"):
        PackedStaging({"lens": (-1, torch.int32)}, torch.device("cpu"), pin_memory=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_staging_on_cuda() -> None:
    staging = PackedStaging(SIZES, torch.device("cuda"), pin_memory=True)
    staging["slots"].np[:6] = np.arange(6)
    staging["lens"].np[:3] = [7, 8, 9]
    slots = staging.stage(staging["slots"], 6)
    lens = staging.stage(staging["lens"], 3)
    assert staging.send() == 2
    assert slots.tolist() == list(range(6)) and lens.tolist() == [7, 8, 9]
