"""KV-cache groups: layout (grouping, shared tensors, page unification), the coordinator over a
full-attention and a sliding-window group (all-or-nothing allocation, window-bounded blocks,
prefix hits every group can resume from), and the scheduler's admission bound."""

from __future__ import annotations

import itertools
import random
import zlib
from dataclasses import dataclass

import pytest
import torch
from kv_cache_utils import kv_cache_config, snapshot

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    SlidingWindowSpec,
    get_kv_cache_config,
    group_layers,
    unify_page_sizes,
)
from pagoda.outputs import ModelRunnerOutput
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.block_pool import NULL_BLOCK_ID
from pagoda.scheduler.kv_cache_manager import KVCacheManager
from pagoda.scheduler.output import SchedulerOutput
from pagoda.scheduler.request import Request
from pagoda.scheduler.scheduler import Scheduler

BLOCK_SIZE = 4
WINDOW = 8


def full(block_size: int = BLOCK_SIZE) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=8, dtype=torch.float32)


def sliding(window: int = WINDOW, block_size: int = BLOCK_SIZE) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size, num_kv_heads=2, head_size=8, dtype=torch.float32, sliding_window=window
    )


PAGE = full().page_size_bytes  # 2 (K, V) * 4 tokens * 2 heads * 8 * 4 bytes


@dataclass(frozen=True)
class LargePageSpec(FullAttentionSpec):
    """A layer whose page is 8 attention pages (think of a state layer)."""

    @property
    def page_size_bytes(self) -> int:
        return 8 * super().page_size_bytes


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def hybrid_manager(num_blocks: int, enable_caching: bool = True) -> tuple[KVCacheManager, int, int]:
    """A sliding layer then a full one (Gemma 2 order): group 0 is the sliding group."""
    config = kv_cache_config(num_blocks, BLOCK_SIZE, {"layers.0": sliding(), "layers.1": full()})
    manager = KVCacheManager(config, enable_caching)
    swa, fa = (
        next(g for g, s in enumerate(config.group_specs) if isinstance(s, kind))
        for kind in (SlidingWindowSpec, FullAttentionSpec)
    )
    return manager, swa, fa


def admit(manager: KVCacheManager, request: Request, num_new: int | None = None) -> int:
    """Admit like the scheduler (prefix hit, then `num_new` tokens, default all); return the hit."""
    manager.update_block_hashes(request)
    hits, num_hit = manager.get_computed_blocks(request)
    if num_new is None:
        num_new = request.num_tokens - num_hit
    assert manager.allocate_slots(request, num_new, hits) is not None
    request.num_computed_tokens = num_hit + num_new
    manager.cache_blocks(request, request.num_computed_tokens)
    return num_hit


def group_key(manager: KVCacheManager, gid: int, request: Request, index: int) -> bytes:
    return manager.managers[gid].block_key(request.block_hashes, index)


def is_cached(manager: KVCacheManager, gid: int, request: Request, index: int) -> bool:
    return manager.block_pool.get_cached_block(group_key(manager, gid, request, index)) is not None


def check_ownership(manager: KVCacheManager) -> None:
    """Every real block is held by one group only, with a reference per request holding it."""
    owner: dict[int, int] = {}
    refs: dict[int, int] = {}
    for gid, group in enumerate(manager.managers):
        for blocks in group.req_to_blocks.values():
            for block in blocks:
                if block.block_id == NULL_BLOCK_ID:
                    continue
                assert owner.setdefault(block.block_id, gid) == gid, f"block {block.block_id} in two groups"
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
    for block in manager.block_pool.blocks[1:]:
        assert block.ref_cnt == refs.get(block.block_id, 0), f"block {block.block_id}"


# ---- layout: grouping, shared tensors, page sizes -----------------------------------------


def test_gemma2_alternating_layers_make_two_groups_sharing_two_tensors() -> None:
    specs: dict[str, KVCacheSpec] = {f"layers.{i}": sliding() if i % 2 == 0 else full() for i in range(4)}
    available = PAGE * 2 * 37 + PAGE  # a page short of 38 blocks per tensor
    config = get_kv_cache_config(specs, available)
    assert [(g.layer_names, g.kv_cache_spec) for g in config.kv_cache_groups] == [
        (("layers.0", "layers.2"), sliding()),
        (("layers.1", "layers.3"), full()),
    ]
    assert config.num_blocks == available // (PAGE * 2) == 37
    assert [t.shared_by for t in config.kv_cache_tensors] == [("layers.0", "layers.1"), ("layers.2", "layers.3")]
    assert all(t.size_bytes == PAGE * 37 for t in config.kv_cache_tensors)
    assert config.block_sizes == (BLOCK_SIZE, BLOCK_SIZE)
    # Every layer views exactly one tensor.
    assert sorted(name for t in config.kv_cache_tensors for name in t.shared_by) == sorted(specs)
    assert get_kv_cache_config(specs, 0, num_blocks=5).num_blocks == 5


def test_gemma3_five_to_one_layers_make_groups_of_two() -> None:
    specs: dict[str, KVCacheSpec] = {f"layers.{i}": full() if i % 6 == 5 else sliding() for i in range(12)}
    groups = group_layers(specs)
    assert [g.layer_names for g in groups] == [
        ("layers.0", "layers.1"),
        ("layers.2", "layers.3"),
        ("layers.4", "layers.6"),
        ("layers.7", "layers.8"),
        ("layers.9", "layers.10"),
        ("layers.5", "layers.11"),
    ]
    assert [type(g.kv_cache_spec) for g in groups] == [SlidingWindowSpec] * 5 + [FullAttentionSpec]
    config = get_kv_cache_config(specs, PAGE * 2 * 100)
    assert config.num_blocks == 100
    assert len(config.kv_cache_tensors) == 2
    assert [len(t.shared_by) for t in config.kv_cache_tensors] == [6, 6]
    assert config.kv_cache_tensors[0].shared_by == tuple(g.layer_names[0] for g in groups)
    assert sorted(name for t in config.kv_cache_tensors for name in t.shared_by) == sorted(specs)


def test_close_layer_counts_make_one_group_per_spec() -> None:
    specs: dict[str, KVCacheSpec] = {f"s.{i}": sliding() for i in range(13)}
    specs.update({f"f.{i}": full() for i in range(14)})
    groups = group_layers(specs)
    assert [len(g.layer_names) for g in groups] == [13, 14]
    config = get_kv_cache_config(specs, PAGE * 14 * 10)
    assert (config.num_blocks, len(config.kv_cache_tensors)) == (10, 14)
    assert config.kv_cache_tensors[-1].shared_by == ("f.13",)


def test_large_pages_scale_the_attention_block_size() -> None:
    large = LargePageSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype=torch.float32)
    assert large.page_size_bytes == 8 * PAGE
    specs: dict[str, KVCacheSpec] = {"layers.0": sliding(), "layers.1": full(), "state.0": large}
    unified = unify_page_sizes(specs)
    assert unified == {"layers.0": sliding(block_size=32), "layers.1": full(block_size=32), "state.0": large}
    assert {spec.page_size_bytes for spec in unified.values()} == {8 * PAGE}
    config = get_kv_cache_config(specs, 8 * PAGE * 20)
    assert config.num_blocks == 20
    assert sorted(config.block_sizes) == [4, 32, 32]
    assert [t.size_bytes for t in config.kv_cache_tensors] == [8 * PAGE * 20]

    # More heads: a page twice as large, likewise.
    wide = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=4, head_size=8, dtype=torch.float32)
    assert unify_page_sizes({"a": full(), "b": wide}) == {"a": full(block_size=8), "b": wide}


def test_a_page_that_does_not_divide_the_largest_is_refused() -> None:
    odd = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=3, head_size=8, dtype=torch.float32)
    with pytest.raises(ValueError, match=rf"layer 'layers\.1'.*{PAGE} bytes.*largest page \({odd.page_size_bytes}"):
        unify_page_sizes({"layers.0": odd, "layers.1": full()})
    with pytest.raises(ValueError, match=r"layer 'layers\.1'"):
        get_kv_cache_config({"layers.0": odd, "layers.1": full()}, 1 << 20)


# ---- the coordinator: allocation --------------------------------------------------------


def test_allocation_is_all_groups_or_nothing(make_request) -> None:
    manager, swa, fa = hybrid_manager(num_blocks=12)  # 11 usable
    pool = manager.block_pool
    big = make_request("big", list(range(24)))  # 6 blocks per group: 12 > 11
    manager.update_block_hashes(big)
    before = snapshot(manager)
    assert manager.allocate_slots(big, 24) is None
    assert snapshot(manager) == before
    assert manager.get_block_ids(big) == ([], [])
    assert manager.prefix_cache_queries == 0

    r = make_request("r", list(range(100, 140)))
    admit(manager, r, num_new=16)  # 4 blocks per group
    assert manager.num_held_blocks(r) == [4, 4]
    assert pool.num_free_blocks == 3
    held = {gid: list(manager.managers[gid].req_to_blocks["r"]) for gid in (swa, fa)}

    # The next 24 tokens need 6 more blocks per group. The window of token 16 starts at 9, so the
    # sliding group's blocks 0 and 1 go back first (5 free), which is still too few.
    before = snapshot(manager)
    assert manager.allocate_slots(r, 24) is None
    assert manager.managers[fa].req_to_blocks["r"] == held[fa]
    assert manager.managers[swa].req_to_blocks["r"] == [pool.null_block] * 2 + held[swa][2:]
    assert pool.num_free_blocks == before[0] + 2
    assert [b.ref_cnt for b in held[swa][:2]] == [0, 0]
    assert manager.get_block_ids(r)[swa][:2] == [NULL_BLOCK_ID] * 2
    check_ownership(manager)

    # Apart from that freeing, a failed allocation changes nothing; a smaller one fits.
    before = snapshot(manager)
    assert manager.allocate_slots(r, 24) is None
    assert snapshot(manager) == before
    new_ids = manager.allocate_slots(r, 4)
    assert new_ids is not None and [len(ids) for ids in new_ids] == [1, 1]
    manager.free(r)
    manager.check_idle()


def test_hits_of_every_group_are_taken_before_any_group_gets_new_blocks(make_request) -> None:
    """Regression: a new block for one group used to be taken before a later group touched its
    prefix-cache hits, so it could evict a free hit and hand it to two groups at once."""
    config = kv_cache_config(9, BLOCK_SIZE, {"layers.0": full(), "layers.1": sliding()})  # 8 usable
    manager = KVCacheManager(config)
    pool = manager.block_pool
    a = make_request("a", list(range(8)))
    d = make_request("d", list(range(100, 108)))
    for request in (a, d):  # all blocks full and cached, a's freed first: evicted first
        admit(manager, request)
        manager.free(request)
    a_blocks = [
        list(group.block_pool.get_cached_block(group.block_key(a.block_hashes, i)) for i in range(2))
        for group in manager.managers
    ]
    assert [b.block_id for b in pool._free_queue][:4] == [b.block_id for blocks in a_blocks for b in reversed(blocks)]

    b = make_request("b", [*range(8), 50])
    assert admit(manager, b) == 8
    check_ownership(manager)
    ids = manager.get_block_ids(b)
    d_ids = {pool.get_cached_block(group_key(manager, g, d, i)) for g in range(2) for i in range(2)}
    assert None in d_ids  # d's blocks were evicted for b's two new ones
    for gid in range(2):
        assert ids[gid][:2] == [block.block_id for block in a_blocks[gid]]
        assert all(is_cached(manager, gid, a, i) for i in range(2))
        assert ids[gid][2] not in {block.block_id for blocks in a_blocks for block in blocks}
    manager.free(b)
    manager.check_idle()


def test_decoding_holds_only_the_window_in_the_sliding_group(make_request) -> None:
    manager, swa, fa = hybrid_manager(num_blocks=64)
    pool = manager.block_pool
    usable = pool.num_usable_blocks
    r = make_request("r", list(range(5)))
    admit(manager, r)
    rose = 0
    while r.num_tokens < 4 * WINDOW:
        r.append_output_token(r.num_tokens)
        manager.update_block_hashes(r)
        free_before = pool.num_free_blocks
        nulls_before = manager.get_block_ids(r)[swa].count(NULL_BLOCK_ID)
        new_ids = manager.allocate_slots(r, 1)
        assert new_ids is not None
        position = r.num_computed_tokens  # the token computed this step
        r.num_computed_tokens += 1
        manager.cache_blocks(r, r.num_computed_tokens)

        held = manager.num_held_blocks(r)
        first_needed = max(0, position - WINDOW + 1) // BLOCK_SIZE
        assert held[fa] == cdiv(r.num_computed_tokens, BLOCK_SIZE)
        assert held[swa] == cdiv(r.num_computed_tokens, BLOCK_SIZE) - first_needed
        assert held[swa] <= WINDOW // BLOCK_SIZE + 2
        assert pool.num_free_blocks == usable - sum(held)
        ids = manager.get_block_ids(r)
        assert len(ids[swa]) == len(ids[fa]) == cdiv(r.num_computed_tokens, BLOCK_SIZE)
        assert ids[swa][:first_needed] == [NULL_BLOCK_ID] * first_needed
        assert NULL_BLOCK_ID not in ids[swa][first_needed:] + ids[fa]
        # Blocks that fell out of the window went back to the pool.
        nulled = ids[swa].count(NULL_BLOCK_ID) - nulls_before
        assert pool.num_free_blocks - free_before == nulled - sum(len(x) for x in new_ids)
        rose += pool.num_free_blocks > free_before
    assert rose > 0
    assert manager.num_held_blocks(r)[swa] <= WINDOW // BLOCK_SIZE + 2 < manager.num_held_blocks(r)[fa]
    manager.free(r)
    manager.check_idle()


@pytest.mark.parametrize("first_chunk", [1, 3, None])
@pytest.mark.parametrize("chunk", [1, 3, 4, 6, 8, 13, 16])
def test_prefill_chunks_hold_at_most_the_window_plus_the_chunk(
    make_request, chunk: int, first_chunk: int | None
) -> None:
    manager, swa, fa = hybrid_manager(num_blocks=64)
    spec = manager.kv_cache_config.group_specs[swa]
    r = make_request("r", list(range(100)))
    manager.update_block_hashes(r)
    while r.num_computed_tokens < r.num_tokens:
        num_new = min(chunk, r.num_tokens - r.num_computed_tokens)
        if r.num_computed_tokens == 0 and first_chunk is not None:
            num_new = first_chunk  # later chunks start off block boundaries
        assert manager.allocate_slots(r, num_new) is not None
        start = r.num_computed_tokens
        r.num_computed_tokens += num_new
        manager.cache_blocks(r, r.num_computed_tokens)
        held = manager.num_held_blocks(r)
        assert held[swa] <= (WINDOW + chunk) // BLOCK_SIZE + 2
        assert held[swa] <= spec.max_blocks_per_request(r.num_computed_tokens, chunk)
        assert held[fa] == cdiv(r.num_computed_tokens, BLOCK_SIZE)
        # Every key the chunk reads is in a real block.
        ids = manager.get_block_ids(r)[swa]
        first_read = max(0, start - WINDOW + 1)
        assert NULL_BLOCK_ID not in ids[first_read // BLOCK_SIZE :]
    manager.free(r)
    manager.check_idle()


# ---- the coordinator: prefix hits across groups -----------------------------------------


def test_a_repeated_prompt_hits_in_both_groups(make_request) -> None:
    manager, swa, fa = hybrid_manager(num_blocks=64)
    prompt = list(range(41))
    a = make_request("a", prompt)
    assert admit(manager, a) == 0
    a_ids = manager.get_block_ids(a)

    b = make_request("b", prompt)
    manager.update_block_hashes(b)
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 40
    assert [block.block_id for block in hits[fa]] == a_ids[fa][:10]
    # Resuming at 40 reads keys 33..39: blocks 8 and 9; the ones before are null.
    assert [block.block_id for block in hits[swa]] == [NULL_BLOCK_ID] * 8 + a_ids[swa][8:10]

    # Never more than num_tokens - 1, and on block boundaries.
    for n in range(1, 46):
        c = make_request(f"c{n}", [*prompt, 99, 98, 97, 96][:n])
        manager.update_block_hashes(c)
        hits, num_hit = manager.get_computed_blocks(c)
        assert num_hit == min(40, (n - 1) // BLOCK_SIZE * BLOCK_SIZE), n
        assert [len(blocks) * BLOCK_SIZE for blocks in hits] == [num_hit, num_hit]

    manager.free(a)
    assert admit(manager, b) == 40
    assert manager.get_block_ids(b)[fa][:10] == a_ids[fa][:10]
    assert manager.get_block_ids(b)[swa][:10] == [NULL_BLOCK_ID] * 8 + a_ids[swa][8:10]
    assert manager.num_held_blocks(b) == ([3, 11] if swa == 0 else [11, 3])
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (82, 40)
    check_ownership(manager)
    manager.free(b)
    manager.check_idle()


def test_a_hit_shrinks_in_both_groups_when_the_window_before_it_was_evicted(make_request) -> None:
    manager, swa, fa = hybrid_manager(num_blocks=25)  # 24 usable
    pool = manager.block_pool
    prompt = list(range(41))
    a = make_request("a", prompt)
    admit(manager, a)  # 11 blocks per group, blocks 0-9 of each cached
    manager.free(a)  # the sliding group's blocks are freed first: evicted first

    # Filling the pool evicts the two uncached tails, the 2 unused blocks, then the sliding
    # group's blocks 9 and 8: the window right before 40.
    filler = make_request("filler", list(range(500, 512)))
    admit(manager, filler)
    assert not is_cached(manager, swa, a, 9) and not is_cached(manager, swa, a, 8)
    assert all(is_cached(manager, swa, a, i) for i in range(8))
    assert all(is_cached(manager, fa, a, i) for i in range(10))

    b = make_request("b", prompt)
    manager.update_block_hashes(b)
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 32  # the full group could resume at 40, the sliding one only at 32
    assert [len(blocks) for blocks in hits] == [8, 8]
    assert [block.block_id for block in hits[swa]][:6] == [NULL_BLOCK_ID] * 6
    assert hits[swa][6:] == [pool.get_cached_block(group_key(manager, swa, a, i)) for i in (6, 7)]
    assert hits[fa] == [pool.get_cached_block(group_key(manager, fa, a, i)) for i in range(8)]

    assert admit(manager, b) == 32
    assert manager.num_held_blocks(b) == ([5, 11] if swa == 0 else [11, 5])
    check_ownership(manager)
    manager.free(b)
    manager.free(filler)
    manager.check_idle()


def test_cache_salt_isolates_every_group(make_request) -> None:
    manager, _, _ = hybrid_manager(num_blocks=64)
    prompt = list(range(20))
    owner = make_request("owner", prompt, cache_salt="tenant-a")
    admit(manager, owner)
    same = make_request("same", prompt, cache_salt="tenant-a")
    manager.update_block_hashes(same)
    assert manager.get_computed_blocks(same)[1] == 16
    for request in (make_request("other", prompt, cache_salt="tenant-b"), make_request("plain", prompt)):
        manager.update_block_hashes(request)
        assert manager.get_computed_blocks(request) == (([], []), 0)
    manager.free(owner)
    manager.check_idle()


def test_unequal_block_sizes_hit_on_multiples_of_their_lcm(make_request) -> None:
    large = LargePageSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype=torch.float32)
    config = get_kv_cache_config({"layers.0": sliding(), "layers.1": full(), "state.0": large}, 0, num_blocks=64)
    manager = KVCacheManager(config)
    assert sorted(config.block_sizes) == [4, 32, 32]
    assert (manager.hash_block_size, manager.hit_alignment) == (4, 32)
    prompt = list(range(100))
    a = make_request("a", prompt)
    admit(manager, a)
    for n in (1, 31, 32, 33, 64, 65, 90, 97, 100, 101, 120):
        c = make_request(f"c{n}", [*prompt, *range(1000, 1020)][:n])
        manager.update_block_hashes(c)
        hits, num_hit = manager.get_computed_blocks(c)
        assert num_hit == min(96, (n - 1) // 32 * 32), n
        assert [len(blocks) * size for blocks, size in zip(hits, config.block_sizes, strict=True)] == [num_hit] * 3

    manager.free(a)
    b = make_request("b", [*prompt, 5, 6])
    assert admit(manager, b) == 96
    assert [len(ids) for ids in manager.get_block_ids(b)] == [cdiv(102, size) for size in config.block_sizes]
    check_ownership(manager)
    manager.free(b)
    manager.check_idle()


# ---- the scheduler's admission bound ------------------------------------------------------


def make_scheduler(config: KVCacheConfig, budget: int = 16, max_model_len: int = 256) -> Scheduler:
    scheduler_config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=max_model_len)
    return Scheduler(scheduler_config, CacheConfig(block_size=BLOCK_SIZE), config)


def drive(scheduler: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    """Step to the end; every sampled token is 1. Checks the window bound at every step."""
    kv = scheduler.kv_cache_manager
    specs = kv.kv_cache_config.group_specs
    steps = []
    while scheduler.has_unfinished_requests() or scheduler.has_finished_requests():
        assert len(steps) < max_steps
        so = scheduler.schedule()
        steps.append(so)
        for req_id, num in so.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            start = request.num_computed_tokens - num
            for gid, spec in enumerate(specs):
                assert kv.num_held_blocks(request)[gid] <= spec.max_blocks_per_request(
                    request.num_computed_tokens, scheduler.max_num_batched_tokens
                )
                first_read = max(0, start - spec.sliding_window + 1) if isinstance(spec, SlidingWindowSpec) else 0
                assert NULL_BLOCK_ID not in kv.get_block_ids(request)[gid][first_read // spec.block_size :]
        req_ids = list(so.num_scheduled_tokens)
        sampled = [[1] if scheduler.requests[r].num_pending_tokens else [] for r in req_ids]
        scheduler.update_from_output(so, ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled))
    return steps


def test_add_request_refuses_what_could_never_fit(make_request) -> None:
    config = kv_cache_config(40, BLOCK_SIZE, {"layers.0": sliding(), "layers.1": full()})  # 39 usable
    scheduler = make_scheduler(config)
    # 150 + 50 tokens, 199 hold KV: 50 full blocks, and the window + a 16-token chunk: 7.
    needed = config.max_blocks_per_request(199, 16)
    assert needed == 50 + 7
    with pytest.raises(ValueError, match=rf"may need {needed} KV cache blocks .*the pool has 39"):
        scheduler.add_request(make_request("long", list(range(150)), max_tokens=50))
    assert not scheduler.has_unfinished_requests()
    # 31 + 8 tokens, 38 hold KV: 10 + 7 blocks.
    scheduler.add_request(make_request("fits", list(range(31)), max_tokens=8))
    drive(scheduler)
    scheduler.check_idle()


def test_a_sliding_group_lets_a_long_request_fit_a_small_pool(make_request) -> None:
    # 200 + 50 tokens: full attention would need 63 blocks.
    prompt, max_tokens = list(range(200)), 50
    assert FullAttentionSpec.max_blocks_per_request(full(), 249, 16) == 63
    full_only = make_scheduler(kv_cache_config(8, BLOCK_SIZE))
    with pytest.raises(ValueError, match=r"may need 63 KV cache blocks .*the pool has 7"):
        full_only.add_request(make_request("r", prompt, max_tokens=max_tokens))

    # Sliding only: the window (8) and a 16-token chunk take at most 7 blocks.
    sliding_only = make_scheduler(kv_cache_config(8, BLOCK_SIZE, {"layers.0": sliding(), "layers.1": sliding()}))
    r = make_request("r", prompt, max_tokens=max_tokens)
    sliding_only.add_request(r)
    steps = drive(sliding_only)
    assert r.num_output_tokens == max_tokens
    assert sliding_only.num_preemptions == 0
    assert len(steps) >= 200 // 16 + max_tokens
    sliding_only.check_idle()

    # Full + sliding: 63 + 7 blocks, not 2 * 63.
    hybrid = make_scheduler(kv_cache_config(71, BLOCK_SIZE, {"layers.0": sliding(), "layers.1": full()}))
    r = make_request("r", prompt, max_tokens=max_tokens)
    hybrid.add_request(r)
    drive(hybrid)
    assert r.num_output_tokens == max_tokens
    hybrid.check_idle()
    too_small = make_scheduler(kv_cache_config(70, BLOCK_SIZE, {"layers.0": sliding(), "layers.1": full()}))
    with pytest.raises(ValueError, match=r"may need 70 KV cache blocks .*the pool has 69"):
        too_small.add_request(make_request("r", prompt, max_tokens=max_tokens))


# ---- random workloads through the scheduler ---------------------------------------------


class GroupRunner:
    """Plays the runner for every group: computing position p of a request writes (group, key of
    its prefix up to p) into p's slot of that group's block; each scheduled token checks that
    every key it reads (all earlier ones, or the window's) is its own. Freed blocks are zeroed."""

    def __init__(self, config: KVCacheConfig) -> None:
        self.specs = config.group_specs
        # req_id -> (token ids, block table per group, computed tokens)
        self.requests: dict[str, tuple[list[int], list[list[int]], list[int]]] = {}
        self.kv: dict[tuple[int, int], tuple[int, int]] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        freed = set(so.freed_block_ids)
        self.kv = {slot: value for slot, value in self.kv.items() if slot[0] not in freed}
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            tables = [list(ids) for ids in new.block_ids]
            self.requests[new.req_id] = (list(new.prompt_token_ids), tables, [new.num_computed_tokens])
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if cached.resumed_from_preemption[i]:
                assert new_ids is not None and cached.resumed_token_ids[i] is not None
                tables = [list(ids) for ids in new_ids]
                self.requests[req_id] = (list(cached.resumed_token_ids[i]), tables, [cached.num_computed_tokens[i]])
                continue
            assert self.requests[req_id][2] == [cached.num_computed_tokens[i]]
            if new_ids is not None:
                for table, ids in zip(self.requests[req_id][1], new_ids, strict=True):
                    table.extend(ids)
        written: dict[int, tuple[str, int]] = {}
        sampled = []
        for req_id, num in so.num_scheduled_tokens.items():
            tokens, tables, computed = self.requests[req_id]
            start = computed[0]
            computed[0] += num
            keys = list(itertools.accumulate(tokens[: start + num], lambda key, token: hash((key, token)), initial=0))[
                1:
            ]
            for gid, spec in enumerate(self.specs):
                size = spec.block_size
                for p in range(start, start + num):
                    block = tables[gid][p // size]
                    assert block != NULL_BLOCK_ID, f"{req_id}: position {p} written to the null block"
                    assert written.setdefault(block, (req_id, gid)) == (req_id, gid), f"block {block} written twice"
                    self.kv[block, p % size] = (gid, keys[p])
                first = max(0, start - spec.sliding_window + 1) if isinstance(spec, SlidingWindowSpec) else 0
                for p in range(first, start + num):
                    value = self.kv.get((tables[gid][p // size], p % size))
                    assert value == (gid, keys[p]), f"{req_id}: group {gid} position {p} reads KV it did not compute"
            if computed[0] == len(tokens):
                token = zlib.crc32(f"{req_id[:2]}:{len(tokens)}".encode()) % 50
                tokens.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        req_ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


LAYOUTS = {
    "sliding+full": ({"layers.0": sliding(), "layers.1": full()}, 30),
    "full+sliding, window 5": (
        {"layers.0": full(), "layers.1": sliding(5), "layers.2": full(), "layers.3": sliding(5)},
        30,
    ),
    "sliding only": ({"layers.0": sliding(), "layers.1": sliding()}, 10),
    "large pages": (
        {
            "layers.0": sliding(),
            "layers.1": full(),
            "state.0": LargePageSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype=torch.float32),
        },
        34,
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_read_only_their_own_kv_in_every_group(layout: str, seed: int) -> None:
    specs, num_blocks = LAYOUTS[layout]
    rng = random.Random(seed)
    config = kv_cache_config(num_blocks, BLOCK_SIZE, specs)
    scheduler = make_scheduler(config, budget=16, max_model_len=96)
    runner = GroupRunner(config)
    prefixes = [[rng.randrange(100) for _ in range(rng.randrange(50))] for _ in range(3)]
    for i in range(30):
        tokens = [*rng.choice(prefixes), *(rng.randrange(100) for _ in range(rng.randrange(1, 30)))][:90]
        salt = rng.choice([None, None, "tenant"])
        request = Request(f"r{i}", tokens, SamplingParams(max_tokens=rng.randrange(1, 20)), {3}, cache_salt=salt)
        scheduler.add_request(request)
        for _ in range(rng.randrange(4)):
            so = scheduler.schedule()
            scheduler.update_from_output(so, runner.execute(so))
            check_ownership(scheduler.kv_cache_manager)
    for _ in range(2000):
        if not (scheduler.has_unfinished_requests() or scheduler.has_finished_requests()):
            break
        so = scheduler.schedule()
        scheduler.update_from_output(so, runner.execute(so))
        check_ownership(scheduler.kv_cache_manager)
    scheduler.check_idle()
    assert not runner.requests


def test_holds_tokens_is_false_while_a_group_frees_blocks_as_tokens_advance(make_request) -> None:
    """A sliding-window group may let blocks go at any step: the decode shortcut never applies."""
    manager, _, _ = hybrid_manager(32)
    request = make_request("a", list(range(6)))
    admit(manager, request)
    assert not manager.holds_tokens(request, 7)
