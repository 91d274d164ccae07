"""KV cache manager and block pool: hashing, prefix hits, reference counts, eviction, idle check."""

from __future__ import annotations

import random

import pytest
from kv_cache_utils import kv_cache_config, snapshot

from pagoda.scheduler.block_pool import NULL_BLOCK_ID, BlockPool
from pagoda.scheduler.kv_cache_manager import ROOT_BLOCK_HASH, KVCacheManager, block_extra_keys, hash_block_tokens
from pagoda.scheduler.output import BlockIds
from pagoda.scheduler.request import Request

BLOCK_SIZE = 4


def make_manager(num_blocks: int = 16, enable_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(kv_cache_config(num_blocks, BLOCK_SIZE), enable_caching)


def admit(manager: KVCacheManager, request: Request) -> BlockIds:
    """Admit a request the way the scheduler does: prefix hit, allocate the rest, compute it;
    return its block ids per group."""
    manager.update_block_hashes(request)
    hit_blocks, num_hit = manager.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit
    assert manager.allocate_slots(request, num_new, hit_blocks) is not None
    request.num_computed_tokens = num_hit + num_new
    manager.cache_blocks(request, request.num_computed_tokens)
    return manager.get_block_ids(request)


# ---- hashing ------------------------------------------------------------------------------


def test_same_prefix_gives_same_hashes(make_request) -> None:
    manager = make_manager()
    a = make_request("a", list(range(12)))
    b = make_request("b", [*range(12), 50, 51])
    manager.update_block_hashes(a)
    manager.update_block_hashes(b)
    assert len(a.block_hashes) == 3
    assert len(b.block_hashes) == 3  # the 2-token tail is not a full block
    assert a.block_hashes == b.block_hashes
    assert len(set(a.block_hashes)) == 3


def test_changing_one_token_changes_that_block_and_all_later_ones(make_request) -> None:
    manager = make_manager()
    a = make_request("a", list(range(12)))
    tokens = list(range(12))
    tokens[5] = 99  # block 1
    b = make_request("b", tokens)
    manager.update_block_hashes(a)
    manager.update_block_hashes(b)
    assert a.block_hashes[0] == b.block_hashes[0]
    assert a.block_hashes[1] != b.block_hashes[1]
    assert a.block_hashes[2] != b.block_hashes[2]  # same tokens, different parent


def test_incremental_hashes_match_hashes_of_the_whole_sequence(make_request) -> None:
    manager = make_manager()
    growing = make_request("a", list(range(6)))
    manager.update_block_hashes(growing)
    for token in range(6, 14):
        growing.append_output_token(token)
        manager.update_block_hashes(growing)
    whole = make_request("b", list(range(14)))
    manager.update_block_hashes(whole)
    assert len(growing.block_hashes) == 3
    assert growing.block_hashes == whole.block_hashes


@pytest.mark.parametrize("cache_salt", [None, "tenant-a"])
def test_packed_hashes_equal_the_chain_of_block_hashes(make_request, cache_salt) -> None:
    """`update_block_hashes` packs a span of blocks at once, as the prompt arrives and as outputs
    fill blocks: every hash must be `hash_block_tokens` of its block, chained from the root."""
    rng = random.Random(0)
    manager = make_manager()
    for trial in range(20):
        request = make_request(str(trial), [rng.randrange(2**40) for _ in range(rng.randrange(1, 40))], cache_salt)
        manager.update_block_hashes(request)
        for _ in range(rng.randrange(0, 12)):
            request.append_output_token(rng.randrange(-(2**40), 2**40))
            if rng.random() < 0.5:
                manager.update_block_hashes(request)
        manager.update_block_hashes(request)
        expected, parent = [], ROOT_BLOCK_HASH
        tokens = request.all_token_ids
        for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
            parent = hash_block_tokens(parent, tokens[start : start + BLOCK_SIZE], block_extra_keys(request))
            expected.append(parent)
        assert request.block_hashes == expected


def test_cache_salt_isolates_tenants(make_request) -> None:
    manager = make_manager()
    tokens = list(range(9))
    admit(manager, make_request("owner", tokens, cache_salt="tenant-a"))

    same = make_request("same", tokens, cache_salt="tenant-a")
    other = make_request("other", tokens, cache_salt="tenant-b")
    unsalted = make_request("unsalted", tokens)
    for request in (same, other, unsalted):
        manager.update_block_hashes(request)

    assert manager.get_computed_blocks(same)[1] == 8
    for request in (other, unsalted):
        assert set(request.block_hashes).isdisjoint(same.block_hashes)
        assert manager.get_computed_blocks(request) == (([],), 0)


# ---- prefix hits --------------------------------------------------------------------------


def test_hit_on_a_shared_prefix(make_request) -> None:
    manager = make_manager()
    (a_ids,) = admit(manager, make_request("a", list(range(10))))
    b = make_request("b", [*range(8), 70, 71, 72, 73, 74])
    manager.update_block_hashes(b)
    (hit_blocks,), num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8
    assert [block.block_id for block in hit_blocks] == a_ids[:2]


def test_full_prompt_hit_recomputes_the_last_token(make_request) -> None:
    manager = make_manager()
    admit(manager, make_request("a", list(range(9))))  # blocks 0 and 1 are full and cached

    exact_blocks = make_request("b", list(range(8)))
    manager.update_block_hashes(exact_blocks)
    assert manager.get_computed_blocks(exact_blocks)[1] == 4  # not 8: the last token is recomputed

    one_more = make_request("c", list(range(9)))
    manager.update_block_hashes(one_more)
    assert manager.get_computed_blocks(one_more)[1] == 8


def test_only_full_computed_blocks_are_cached(make_request) -> None:
    manager = make_manager()
    a = make_request("a", list(range(10)))
    manager.update_block_hashes(a)
    assert manager.allocate_slots(a, 6) is not None
    a.num_computed_tokens = 6
    manager.cache_blocks(a, 6)  # block 1 is only half computed

    b = make_request("b", list(range(10)))
    manager.update_block_hashes(b)
    assert manager.get_computed_blocks(b)[1] == 4
    manager.free(a)


def test_two_requests_share_blocks_by_reference_count(make_request) -> None:
    manager = make_manager()
    pool = manager.block_pool
    a = make_request("a", list(range(10)))
    b = make_request("b", [*range(8), 60, 61, 62])
    (a_ids,) = admit(manager, a)
    (b_ids,) = admit(manager, b)
    assert b_ids[:2] == a_ids[:2]
    assert b_ids[2] != a_ids[2]
    assert [pool.blocks[i].ref_cnt for i in a_ids[:2]] == [2, 2]

    manager.free(a)
    assert [pool.blocks[i].ref_cnt for i in a_ids[:2]] == [1, 1]
    manager.free(b)
    assert [pool.blocks[i].ref_cnt for i in a_ids] == [0, 0, 0]
    # Still cached while free: a later request hits them.
    c = make_request("c", list(range(9)))
    manager.update_block_hashes(c)
    assert [block.block_id for block in manager.get_computed_blocks(c)[0][0]] == a_ids[:2]
    manager.check_idle()


# ---- eviction -----------------------------------------------------------------------------


def test_eviction_takes_uncached_blocks_first_then_least_recently_freed_tail_first(make_request) -> None:
    manager = make_manager(num_blocks=9)  # 8 usable blocks
    pool = manager.block_pool
    a = make_request("a", list(range(13)))  # 3 full blocks + a partial one
    b = make_request("b", list(range(100, 108)))  # 2 full blocks
    (a_ids,) = admit(manager, a)
    (b_ids,) = admit(manager, b)
    unused = sorted(set(range(1, 9)) - set(a_ids) - set(b_ids))
    manager.free(a)
    manager.free(b)  # b is freed after a: more recently used

    expected_order = [a_ids[3], *unused, a_ids[2], a_ids[1], a_ids[0], b_ids[1], b_ids[0]]
    cached_before = {block_id for block_id in range(9) if pool.blocks[block_id].block_hash is not None}
    assert cached_before == set(a_ids[:3]) | set(b_ids)

    # The pool's cache keys are the group's keys of the request's block hashes.
    group = manager.managers[0]
    keys = [group.block_key(r.block_hashes, i) for r in (a, b) for i in range(group.num_hashed_blocks(r.block_hashes))]
    assert len(keys) == 5
    taken = []
    for _ in range(8):
        (block,) = pool.get_new_blocks(1)
        taken.append(block.block_id)
        assert block.block_hash is None
        still_cached = {h for h in keys if pool.get_cached_block(h) is not None}
        later = [i for i in expected_order[len(taken) :] if i in cached_before]
        assert {pool.blocks[i].block_hash for i in later} == still_cached
    assert taken == expected_order
    pool.free_blocks(pool.blocks[i] for i in taken)
    manager.check_idle()


def test_a_hit_on_a_free_block_takes_it_out_of_eviction_order(make_request) -> None:
    manager = make_manager(num_blocks=5)  # 4 usable
    pool = manager.block_pool
    a = make_request("a", list(range(8)))
    (a_ids,) = admit(manager, a)
    manager.free(a)
    b = make_request("b", list(range(9)))
    manager.update_block_hashes(b)
    hit_blocks, _ = manager.get_computed_blocks(b)
    assert manager.allocate_slots(b, 1, hit_blocks) is not None
    assert manager.get_block_ids(b)[0][:2] == a_ids
    assert pool.num_free_blocks == 1
    last = pool.get_new_blocks(1)
    assert last[0].block_id not in a_ids
    pool.free_blocks(last)
    manager.free(b)
    manager.check_idle()


def test_null_block_is_never_allocated_or_freed(make_request) -> None:
    manager = make_manager(num_blocks=6)
    pool = manager.block_pool
    requests = [make_request(f"r{i}", list(range(10 * i, 10 * i + 4))) for i in range(5)]
    handed_out = [block_id for request in requests for block_id in admit(manager, request)[0]]
    assert sorted(handed_out) == [1, 2, 3, 4, 5]
    assert manager.allocate_slots(make_request("x", [1]), 1) is None

    for request in requests:
        manager.free(request)
    pool.free_blocks([pool.null_block])
    assert pool.null_block.ref_cnt == 0
    assert NULL_BLOCK_ID not in [block.block_id for block in pool._free_queue]
    assert NULL_BLOCK_ID not in pool.take_freed_block_ids()
    manager.check_idle()


def test_failed_allocation_leaves_state_unchanged(make_request) -> None:
    manager = make_manager(num_blocks=7)  # 6 usable
    a = make_request("a", list(range(8)))
    admit(manager, a)
    manager.free(a)  # 2 cached free blocks
    hog = make_request("hog", list(range(200, 212)))
    admit(manager, hog)  # takes 3 blocks: the uncached ones first, so a's blocks stay cached

    b = make_request("b", [*range(8), *range(300, 310)])  # hits a's 2 blocks, needs 3 more
    manager.update_block_hashes(b)
    hit_blocks, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8
    before = snapshot(manager)
    assert manager.allocate_slots(b, b.num_tokens - num_hit, hit_blocks) is None
    assert snapshot(manager) == before
    assert manager.get_block_ids(b) == ([],)
    assert manager.prefix_cache_queries == a.num_tokens + hog.num_tokens  # b's failed admission not counted

    running = make_request("c", list(range(400, 404)))
    admit(manager, running)
    before = snapshot(manager)
    assert manager.allocate_slots(running, 12) is None  # 3 more blocks, 2 free
    assert snapshot(manager) == before
    manager.free(hog)
    manager.free(running)
    manager.check_idle()


# ---- figures, freed ids, reset, idle ------------------------------------------------------


def test_usage_and_prefix_cache_hit_rate(make_request) -> None:
    manager = make_manager(num_blocks=11)  # 10 usable
    assert manager.usage == 0.0
    assert manager.prefix_cache_hit_rate == 0.0
    a = make_request("a", list(range(10)))
    admit(manager, a)  # 3 blocks
    assert manager.usage == pytest.approx(0.3)
    b = make_request("b", [*range(8), 90, 91])
    admit(manager, b)  # 2 shared + 1 new
    assert manager.usage == pytest.approx(0.4)
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (20, 8)
    assert manager.prefix_cache_hit_rate == pytest.approx(0.4)
    manager.free(a)
    manager.free(b)
    assert manager.usage == 0.0  # cached free blocks count as free


def test_freed_block_ids_report_blocks_whose_content_is_gone(make_request) -> None:
    manager = make_manager(num_blocks=6)  # 5 usable
    pool = manager.block_pool
    a = make_request("a", list(range(10)))  # 2 full cached blocks + 1 partial
    (a_ids,) = admit(manager, a)
    assert manager.take_freed_block_ids() == []
    manager.free(a)
    assert manager.take_freed_block_ids() == [a_ids[2]]  # cached blocks keep their content
    assert manager.take_freed_block_ids() == []
    taken = pool.get_new_blocks(4)  # 2 unused + the partial one, then evicts a's tail block
    assert manager.take_freed_block_ids() == [a_ids[1]]
    pool.free_blocks(taken)
    manager.take_freed_block_ids()
    manager.reset_prefix_cache()
    assert manager.take_freed_block_ids() == [a_ids[0]]
    manager.check_idle()


def test_reset_prefix_cache_drops_every_hit(make_request) -> None:
    manager = make_manager()
    a = make_request("a", list(range(10)))
    admit(manager, a)
    manager.reset_prefix_cache()  # while a still holds its blocks
    manager.free(a)
    b = make_request("b", list(range(10)))
    manager.update_block_hashes(b)
    assert manager.get_computed_blocks(b) == (([],), 0)
    manager.check_idle()


def test_prefix_caching_off_hashes_nothing_and_never_hits(make_request) -> None:
    manager = make_manager(enable_caching=False)
    a = make_request("a", list(range(10)))
    (a_ids,) = admit(manager, a)
    assert a.block_hashes == []
    manager.free(a)
    assert sorted(manager.take_freed_block_ids()) == sorted(a_ids)
    b = make_request("b", list(range(10)))
    admit(manager, b)
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (0, 0)
    manager.free(b)
    manager.check_idle()


def test_idle_check_passes_when_whole_and_catches_leaks(make_request) -> None:
    manager = make_manager()
    a = make_request("a", list(range(10)))
    admit(manager, a)
    with pytest.raises(AssertionError, match="still hold KV blocks"):
        manager.check_idle()
    manager.free(a)
    manager.check_idle()

    leaked = manager.block_pool.get_new_blocks(1)  # taken outside any request
    with pytest.raises(AssertionError, match="still have references"):
        manager.check_idle()
    manager.block_pool.free_blocks(leaked)
    manager.check_idle()


def test_block_pool_refuses_a_pool_without_usable_blocks() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1)


# ---- decode steps (the fast paths) -----------------------------------------------------------


def decode_one(manager: KVCacheManager, request: Request, token: int) -> BlockIds | None:
    """One decode step as the scheduler and its update run it: a slot for the next token, the
    step computed, the sampled token appended, full blocks cached and hashed."""
    new_block_ids = manager.allocate_slots(request, 1)
    if new_block_ids is None:
        return None
    request.num_computed_tokens += 1
    manager.cache_blocks(request, request.num_computed_tokens)
    request.append_output_token(token)
    manager.update_block_hashes(request)
    return new_block_ids


def test_decode_allocates_exactly_at_block_boundaries_and_caches_each_filled_block(make_request) -> None:
    """A decode step inside a block takes nothing; the step past its end takes one block; every
    block a decode fills becomes a prefix-cache hit for a request with the same tokens."""
    manager = make_manager(num_blocks=16)
    request = make_request("a", list(range(5)), max_tokens=16)
    admit(manager, request)
    request.append_output_token(100)  # the token the prompt's step sampled
    manager.update_block_hashes(request)
    taken = []
    for i in range(10):  # positions 5..14: blocks 1 and 2 fill, block 3 starts at position 12
        new_block_ids = decode_one(manager, request, 101 + i)
        assert new_block_ids is not None
        taken.append(len(new_block_ids[0]))
    # Position 5 is in block 1 (allocated at admission: 5 tokens + the sampled one fill 2 blocks);
    # positions 8 and 12 start blocks 2 and 3.
    assert taken == [0, 0, 0, 1, 0, 0, 0, 1, 0, 0]
    assert manager.num_held_blocks(request) == [4]
    assert len(request.block_hashes) == request.num_tokens // BLOCK_SIZE == 4
    follower = make_request("b", list(request.all_token_ids))
    manager.update_block_hashes(follower)
    hits, num_hit = manager.get_computed_blocks(follower)
    # Blocks 0-2 (12 tokens) were computed; block 3 holds a computed token and a sampled one.
    assert num_hit == 12
    assert [block.block_id for block in hits[0]] == manager.get_block_ids(request)[0][:3]


def test_decode_fast_path_still_refuses_when_the_pool_is_full(make_request) -> None:
    """The step that needs a new block fails, changing nothing, when no block is free."""
    manager = make_manager(num_blocks=3)  # the null block and 2 usable
    request = make_request("a", list(range(7)), max_tokens=16)
    admit(manager, request)
    request.append_output_token(100)
    manager.update_block_hashes(request)
    assert decode_one(manager, request, 101) is not None  # position 7: the last slot of block 1
    before = snapshot(manager)
    assert manager.allocate_slots(request, 1) is None  # position 8 needs a third block
    assert snapshot(manager) == before


def test_holds_tokens_says_when_allocating_would_change_nothing(make_request) -> None:
    """The scheduler's decode shortcut: True exactly while the held blocks have room."""
    manager = make_manager()
    request = make_request("a", list(range(6)))
    assert not manager.holds_tokens(request, 1)  # not admitted: it holds nothing
    admit(manager, request)  # 6 tokens in 2 blocks of 4
    assert manager.holds_tokens(request, 8)
    assert not manager.holds_tokens(request, 9)
    assert manager.allocate_slots(request, 2) == ([],)  # what holds_tokens(8) stood for
    assert manager.allocate_slots(request, 3) is not None
    assert manager.holds_tokens(request, 12)
