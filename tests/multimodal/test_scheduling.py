"""The scheduler's encoder budget and the runner's encoder cache, on plain data (no model)."""

from __future__ import annotations

import pytest
import torch

from pagoda.multimodal.encoder_cache import EncoderCache
from pagoda.multimodal.hashing import block_mm_keys, hash_item
from pagoda.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from pagoda.multimodal.scheduling import EncoderScheduler


def feature(offset: int, length: int, name: str = "a") -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec({"pixel_values": torch.zeros(1)}, "image", name, PlaceholderRange(offset, length))


def test_an_image_is_scheduled_with_the_first_chunk_that_covers_it_and_only_then() -> None:
    encoder = EncoderScheduler(encoder_budget=30)
    images = [feature(4, 10), feature(20, 10)]
    encoder.begin_step()
    assert encoder.inputs_for_chunk("r", images, 0, 8) == (8, [0])  # the chunk ends inside image 0
    encoder.commit("r", images, [0])
    assert encoder.budget_left == 20
    assert encoder.inputs_for_chunk("r", images, 8, 8) == (8, [])  # image 0 encoded, image 1 not reached
    encoder.begin_step()
    assert encoder.inputs_for_chunk("r", images, 16, 20) == (20, [1])
    encoder.free("r")  # preempted: both are encoded again when it resumes
    assert encoder.inputs_for_chunk("r", images, 0, 40) == (40, [0, 1])


def test_a_chunk_stops_before_an_image_over_the_budget_left() -> None:
    encoder = EncoderScheduler(encoder_budget=15)
    images = [feature(2, 10), feature(14, 10)]
    encoder.begin_step()
    assert encoder.inputs_for_chunk("r", images, 0, 30) == (14, [0])
    encoder.commit("r", images, [0])
    # Another request this step: its image does not fit the 5 tokens left; it waits (a 0-token chunk).
    assert encoder.inputs_for_chunk("s", [feature(0, 10)], 0, 12) == (0, [])
    with pytest.raises(ValueError, match="encoder budget"):
        encoder.check_fits("t", [feature(0, 16)])


def test_block_keys_name_the_images_a_block_covers_and_where() -> None:
    images = [feature(4, 10, "x"), feature(20, 4, "y")]
    assert block_mm_keys(images, 0, 4) == b""
    assert block_mm_keys(images, 0, 8) == b"x@4"
    assert block_mm_keys(images, 12, 24) == b"x@-8;y@8"
    assert block_mm_keys([feature(4, 10, "z")], 0, 8) != block_mm_keys(images, 0, 8)
    one = {"pixel_values": torch.ones(2, 3)}
    assert hash_item("image", one) == hash_item("image", {"pixel_values": torch.ones(2, 3)})
    assert hash_item("image", one) != hash_item("image", {"pixel_values": torch.ones(3, 2)})


def test_encoder_cache_keeps_held_entries_and_drops_the_oldest_idle_past_capacity() -> None:
    cache = EncoderCache(capacity=8)
    assert not cache.acquire("a", "r1")
    cache.put("a", torch.zeros(6, 2), "r1")
    assert cache.acquire("a", "r2")  # another request, the same image: a hit
    cache.release("r1")
    cache.release("r2")  # idle now, kept (6 <= 8 tokens)
    assert cache.acquire("a", "r3") and (cache.hits, cache.misses) == (2, 1)
    cache.put("b", torch.zeros(6, 2), "r4")
    cache.release("r3")
    cache.release("r4")  # 12 idle tokens > 8: the older, "a", goes
    assert cache.num_entries == 1 and not cache.acquire("a", "r5") and cache.acquire("b", "r5")
    cache.release("r5")
    assert cache.held_req_ids == []
