"""State groups (MambaSpec) in the KV-cache layout and manager: one block per request however
long it grows, from the pool the attention groups share; pages laid out in the attention
pages' first strip in a hybrid; freed on finish and preemption; prefix caching off for a layout
with a state group (nothing is registered, nothing hits); the idle check covers the group."""

from __future__ import annotations

import pytest
import torch
from kv_cache_utils import kv_cache_config

from pagoda.kv_cache_interface import FullAttentionSpec, MambaSpec, get_kv_cache_config
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.kv_cache_manager import KVCacheManager
from pagoda.scheduler.request import Request

BLOCK_SIZE = 4


def state(block_size: int = BLOCK_SIZE) -> MambaSpec:
    return MambaSpec(block_size, conv_shape=(24, 3), ssm_shape=(4, 8, 16), dtype=torch.float32)


def attention() -> FullAttentionSpec:
    return FullAttentionSpec(BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype=torch.float32)


def request(req_id: str, num_tokens: int) -> Request:
    return Request(req_id, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=4), {0})


def test_pure_state_layout_one_page_per_request() -> None:
    specs = {f"layers.{i}": state() for i in range(3)}
    config = get_kv_cache_config(specs, 0, num_blocks=5)
    (group,) = config.kv_cache_groups
    spec = group.kv_cache_spec
    assert spec.page_size_bytes == spec.state_bytes == (24 * 3 + 4 * 8 * 16) * 4
    assert spec.cache_shape(5) == (1, 5, 24 * 3 + 4 * 8 * 16)
    assert config.max_blocks_per_request(10_000, 64) == 1


def test_hybrid_layout_pads_the_state_page_and_scales_attention_blocks() -> None:
    """The state sits in the first of two strips (K, V) of a page that is a multiple of the
    attention page: the attention block size grows to that page."""
    specs = {"layers.0": state(), "layers.1": attention(), "layers.2": state()}
    config = get_kv_cache_config(specs, 0, num_blocks=6)
    by_kind = {type(group.kv_cache_spec): group.kv_cache_spec for group in config.kv_cache_groups}
    mamba, full = by_kind[MambaSpec], by_kind[FullAttentionSpec]
    unit = attention().page_size_bytes
    assert mamba.page_size_bytes == full.page_size_bytes
    assert mamba.page_size_bytes % unit == 0 and mamba.page_size_bytes >= 2 * mamba.state_bytes
    assert full.block_size == BLOCK_SIZE * mamba.page_size_bytes // unit
    regions, blocks, strip = mamba.cache_shape(6)
    assert (regions, blocks) == (2, 6) and strip * 4 >= mamba.state_bytes


@pytest.mark.parametrize("hybrid", [False, True])
def test_one_state_block_per_request_freed_on_finish_and_preemption(hybrid: bool, caplog) -> None:
    specs = {"layers.0": state()} | ({"layers.1": attention()} if hybrid else {})
    manager = KVCacheManager(kv_cache_config(8, BLOCK_SIZE, specs), enable_caching=True)
    assert not manager.enable_caching and "prefix caching is off" in caplog.text
    state_group = next(i for i, s in enumerate(manager.kv_cache_config.group_specs) if isinstance(s, MambaSpec))
    first = request("a", 10)
    manager.update_block_hashes(first)
    hits, num_hit = manager.get_computed_blocks(first)
    assert num_hit == 0 and all(not blocks for blocks in hits)
    new = manager.allocate_slots(first, 10, hits)
    assert new is not None and len(new[state_group]) == 1
    first.num_computed_tokens = 10
    # Growing (decode, chunks) takes no further state block.
    for _ in range(30):
        grown = manager.allocate_slots(first, 1)
        if grown is None:
            break
        assert grown[state_group] == []
        first.num_computed_tokens += 1
    held_before = manager.num_held_blocks(first)[state_group]
    manager.cache_blocks(first, first.num_computed_tokens)
    assert held_before == 1 and not manager.block_pool._cached
    # Preemption frees everything; the resumed request gets a fresh state block.
    manager.free(first)
    first.num_computed_tokens = 0
    again = manager.allocate_slots(first, 10, tuple([] for _ in manager.managers))
    assert again is not None and len(again[state_group]) == 1
    with pytest.raises(AssertionError, match="still hold KV blocks"):
        manager.check_idle()
    manager.free(first)
    manager.check_idle()


def test_checkpoints_cache_a_state_per_block_and_hit_at_their_ends() -> None:
    """mamba_cache_mode "align": steps are cut at block boundaries, a request holds at most the
    block it reads and the one it writes, passed blocks are cached, and a request with the same
    prefix resumes from the checkpoint at the end of its longest cached whole-block prefix."""
    spec = MambaSpec(BLOCK_SIZE, conv_shape=(24, 3), ssm_shape=(4, 8, 16), dtype=torch.float32, checkpoints=True)
    manager = KVCacheManager(kv_cache_config(16, BLOCK_SIZE, {"layers.0": spec}), enable_caching=True)
    assert manager.enable_caching
    assert manager.cap_at_checkpoint(0, 10) == 4 and manager.cap_at_checkpoint(5, 10) == 3
    assert manager.cap_at_checkpoint(6, 1) == 1
    first = request("a", 14)
    manager.update_block_hashes(first)
    manager.allocate_slots(first, 4, tuple([] for _ in manager.managers))
    while first.num_computed_tokens < 14:
        first.num_computed_tokens += manager.cap_at_checkpoint(first.num_computed_tokens, 14)
        manager.cache_blocks(first, first.num_computed_tokens)
        if first.num_computed_tokens < 14:
            assert manager.allocate_slots(first, manager.cap_at_checkpoint(first.num_computed_tokens, 14)) is not None
        assert manager.num_held_blocks(first)[0] <= 2
    second = request("b", 14)  # the same 14 tokens
    manager.update_block_hashes(second)
    hits, num_hit = manager.get_computed_blocks(second)
    # 13 tokens may hit: whole blocks of 4 -> 12, resumed from the checkpoint after token 12 alone.
    assert num_hit == 12
    null = manager.block_pool.null_block
    assert hits[0][:2] == [null, null] and hits[0][2] is not null
    manager.free(first)
    assert manager.allocate_slots(second, 2, hits) is not None
    manager.free(second)
    manager.check_idle()
