"""`HostBlockIndex`: the host pool's LRU, pins and idle check, without tensors."""

from __future__ import annotations

import pytest

from pagoda.kv_transfer.offload.host_index import HostBlockIndex


def stored(index: HostBlockIndex, *keys: bytes) -> list[int]:
    slots = [index.reserve(key) for key in keys]
    index.commit(keys)
    return slots


def test_saves_become_readable_only_when_committed() -> None:
    index = HostBlockIndex(4)
    slot = index.reserve(b"a")
    assert slot is not None and b"a" not in index and index.is_stored_or_storing(b"a")
    assert index.num_hits([b"a"]) == 0
    index.commit([b"a"])
    assert b"a" in index and index.num_hits([b"a", b"b", b"a"]) == 1
    index.check_idle()


def test_eviction_takes_the_least_recently_used_unpinned_block() -> None:
    index = HostBlockIndex(3)
    stored(index, b"a", b"b", b"c")
    index.pin([b"a"])  # pinned by a load, and now the most recent
    index.unpin(index.pin([b"b"]))  # touched: more recent than c
    slot_c = index.reserve(b"d")
    assert b"c" not in index and index.num_evictions == 1
    index.commit([b"d"])
    assert slot_c == index.pin([b"d"])[0]
    assert index.reserve(b"e") is not None  # b goes (a and d are pinned)
    assert b"b" not in index and b"a" in index
    assert index.reserve(b"f") is None  # a and d pinned, e being written
    with pytest.raises(AssertionError, match="pinned by loads"):
        index.check_idle()


def test_discard_reset_and_idle() -> None:
    index = HostBlockIndex(4)
    stored(index, b"a", b"b")
    index.reserve(b"c")
    index.discard([b"a", b"c"])  # a failed load's blocks, a failed save
    assert b"a" not in index and not index.is_stored_or_storing(b"c")
    slots = index.pin([b"b"])
    index.reset()  # pinned blocks survive a reset
    assert b"b" in index
    index.unpin(slots)
    index.reset()
    assert index.num_cached == 0
    index.check_idle()
    index.reserve(b"x")
    with pytest.raises(AssertionError, match="being written"):
        index.check_idle()
