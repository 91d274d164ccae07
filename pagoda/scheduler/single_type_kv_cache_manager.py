"""The blocks one KV-cache group holds per request, by the kind of layer the group serves.

`FullAttentionManager` keeps a block for every `block_size` tokens of a request.
`SlidingWindowManager` keeps only blocks that some future token can still see: a block wholly
before the window of the request's next token goes back to the pool and its place in the
request's list becomes the null block (indices stay aligned with token positions). Both look
up prefix-cache hits in their own group's part of the shared pool (cache keys carry the
group id), and only blocks whose tokens have all been computed are registered.
`MambaManager` keeps one block per request, its recurrent state, however long it grows;
`MambaCheckpointManager` keeps a state per block boundary, cached like full blocks.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from pagoda.kv_cache_interface import (
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from pagoda.scheduler.block_pool import BlockHash, BlockPool, KVCacheBlock


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class SingleTypeKVCacheManager:
    """One group's blocks per request. `block_hashes` passed in are the request's chained
    hashes at `hash_block_size` tokens; this group's block i is identified by the hash that
    ends at its last token."""

    # Whether `remove_skipped_blocks` may free blocks as the request's tokens advance.
    frees_skipped_blocks = False

    def __init__(
        self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int, hash_block_size: int, enable_caching: bool
    ) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.group_id = group_id
        self.enable_caching = enable_caching
        self._hashes_per_block = spec.block_size // hash_block_size
        self._group_suffix = struct.pack("<I", group_id)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache (or null).
        self.num_cached_blocks: dict[str, int] = {}

    # ---- cache keys -------------------------------------------------------------------------

    def block_key(self, block_hashes: Sequence[BlockHash], index: int) -> BlockHash:
        """The prefix-cache key of this group's block `index`: the prefix hash ending at its last
        token, tagged with the group (groups keep different layers' K/V for the same tokens)."""
        return block_hashes[(index + 1) * self._hashes_per_block - 1] + self._group_suffix

    def num_hashed_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        return len(block_hashes) // self._hashes_per_block

    # ---- allocation -------------------------------------------------------------------------

    def num_blocks_to_allocate(self, req_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]) -> int:
        """Pool blocks that holding `num_tokens` tokens takes: new blocks, plus cache hits that
        sit free in the queue (taking them removes them from it)."""
        held = len(self.req_to_blocks.get(req_id, ())) + len(new_computed_blocks)
        num_new = max(0, cdiv(num_tokens, self.block_size) - held)
        null = self.block_pool.null_block
        return num_new + sum(1 for block in new_computed_blocks if block.ref_cnt == 0 and block is not null)

    def save_new_computed_blocks(self, req_id: str, new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        """Take the prefix-cache hits of a request being admitted (they are already cached)."""
        if req_id in self.req_to_blocks:
            assert not new_computed_blocks, "cache hits are taken only when a request is admitted"
            return
        self.block_pool.touch(new_computed_blocks)
        self.req_to_blocks[req_id] = list(new_computed_blocks)
        self.num_cached_blocks[req_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, req_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks[req_id]
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, req_id: str, block_hashes: Sequence[BlockHash], num_computed_tokens: int) -> None:
        """Register the request's blocks that `num_computed_tokens` computed tokens fill."""
        blocks = self.req_to_blocks.get(req_id)
        if blocks is None:
            return
        start = self.num_cached_blocks[req_id]
        if num_computed_tokens < (start + 1) * self.block_size:
            return  # no block filled since the last call
        end = min(num_computed_tokens // self.block_size, self.num_hashed_blocks(block_hashes), len(blocks))
        null = self.block_pool.null_block
        for i in range(start, end):
            if blocks[i] is not null:
                self.block_pool.cache_block(blocks[i], self.block_key(block_hashes, i))
        self.num_cached_blocks[req_id] = max(start, end)

    def free(self, req_id: str) -> None:
        """Return the request's blocks, tail first, so its prefix stays cached longest."""
        blocks = self.req_to_blocks.pop(req_id, None)
        if blocks is None:
            return
        del self.num_cached_blocks[req_id]
        self.block_pool.free_blocks(reversed(blocks))

    def holds_tokens(self, req_id: str, num_tokens: int) -> bool:
        """Whether the request's blocks already have room for `num_tokens` tokens."""
        blocks = self.req_to_blocks.get(req_id)
        return blocks is not None and len(blocks) * self.block_size >= num_tokens

    def block_ids(self, req_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(req_id, ())]

    # ---- what each kind does differently -----------------------------------------------------

    def remove_skipped_blocks(self, req_id: str, block_hashes: Sequence[BlockHash], num_computed_tokens: int) -> None:
        """Free the blocks no token from `num_computed_tokens` on will read (none for full attention)."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> list[KVCacheBlock]:
        """Cached blocks that let a request skip its first len(result) * block_size <= max_length tokens."""
        raise NotImplementedError


class FullAttentionManager(SingleTypeKVCacheManager):
    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> list[KVCacheBlock]:
        hits = []
        for i in range(min(max_length // self.block_size, self.num_hashed_blocks(block_hashes))):
            block = self.block_pool.get_cached_block(self.block_key(block_hashes, i))
            if block is None:
                break
            hits.append(block)
        return hits


class SlidingWindowManager(SingleTypeKVCacheManager):
    frees_skipped_blocks = True

    def __init__(self, spec: SlidingWindowSpec, *args, **kwargs) -> None:
        super().__init__(spec, *args, **kwargs)
        self.sliding_window = spec.sliding_window
        # A request resuming at a block boundary L reads keys [L - window + 1, L - 1]: the cached
        # blocks it needs right before L.
        self._blocks_before_resume = cdiv(spec.sliding_window - 1, spec.block_size)

    def remove_skipped_blocks(self, req_id: str, block_hashes: Sequence[BlockHash], num_computed_tokens: int) -> None:
        """The next token (position `num_computed_tokens`) reads keys from
        num_computed_tokens - window + 1 on; blocks wholly before that become null.

        A freed block is registered in the prefix cache first when its tokens are known: under
        async scheduling this runs for step N+1 before step N's output would have cached it, and
        its KV is complete by the time any later step (on the same stream) reads it.
        """
        blocks = self.req_to_blocks.get(req_id)
        if blocks is None:
            return
        first_needed = max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size
        null = self.block_pool.null_block
        num_hashed = self.num_hashed_blocks(block_hashes) if self.enable_caching else 0
        freed = []
        # Blocks before an already-null one were skipped at an earlier step.
        for i in range(min(first_needed, len(blocks)) - 1, -1, -1):
            if blocks[i] is null:
                break
            if i < num_hashed:
                self.block_pool.cache_block(blocks[i], self.block_key(block_hashes, i))
            freed.append(blocks[i])
            blocks[i] = null
        self.block_pool.free_blocks(freed)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> list[KVCacheBlock]:
        """Scan from the right for `_blocks_before_resume` consecutive cached blocks; those before
        the run are null (never read again). A run that reaches block 0 hits even when shorter."""
        max_blocks = min(max_length // self.block_size, self.num_hashed_blocks(block_hashes))
        null = self.block_pool.null_block
        hits = [null] * max_blocks
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            block = self.block_pool.get_cached_block(self.block_key(block_hashes, i))
            if block is None:
                run = 0
                continue
            hits[i] = block
            run += 1
            if run >= self._blocks_before_resume:
                return hits[: i + run]
        return hits[:run]


class EncoderOnlyManager(SingleTypeKVCacheManager):
    """Encoder layers keep nothing between steps: no blocks, no cache hits (see EncoderOnlyAttentionSpec)."""

    def num_blocks_to_allocate(self, req_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]) -> int:
        return 0

    def allocate_new_blocks(self, req_id: str, num_tokens: int) -> list[KVCacheBlock]:
        return []

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> list[KVCacheBlock]:
        return []


class MambaManager(SingleTypeKVCacheManager):
    """One block per request: its conv and SSM state, updated in place as tokens are computed.

    The state at a block boundary is gone once later tokens ran, so no block is ever
    registered in the prefix cache and nothing hits (the `KVCacheManager` turns caching off
    for a model with such a group; `MambaCheckpointManager` keeps states to hit). A preempted request frees its block and recomputes its
    state from the first token when it resumes."""

    def num_blocks_to_allocate(self, req_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]) -> int:
        return 0 if self.req_to_blocks.get(req_id) else 1

    def allocate_new_blocks(self, req_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks[req_id]
        if blocks:
            return []
        blocks.extend(self.block_pool.get_new_blocks(1))
        return list(blocks)

    def holds_tokens(self, req_id: str, num_tokens: int) -> bool:
        return bool(self.req_to_blocks.get(req_id))

    def cache_blocks(self, req_id: str, block_hashes: Sequence[BlockHash], num_computed_tokens: int) -> None:
        """Nothing to register: the block holds the state after the latest token, not at a boundary."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> list[KVCacheBlock]:
        return []


class MambaCheckpointManager(SlidingWindowManager):
    """mamba_cache_mode "align": block i holds the state after (i + 1) * block_size tokens once
    the request passed that point (a checkpoint, cached under the prefix's hash), and the block
    of the latest token holds the running state. Steps end at the boundaries they reach (see
    `KVCacheManager.cap_at_checkpoint`), so each checkpoint is exact.

    The next step reads only the state after its first token's predecessor: the block holding
    token num_computed - 1, as a sliding window of 2 tokens would keep; blocks before it go back
    to the pool, cached. A hit resumes from one cached checkpoint, the blocks before it null."""

    def __init__(
        self, spec: MambaSpec, block_pool: BlockPool, group_id: int, hash_block_size: int, enable_caching: bool
    ):
        SingleTypeKVCacheManager.__init__(self, spec, block_pool, group_id, hash_block_size, enable_caching)
        self.sliding_window = 2
        self._blocks_before_resume = 1


def make_manager(
    spec: KVCacheSpec, block_pool: BlockPool, group_id: int, hash_block_size: int, enable_caching: bool
) -> SingleTypeKVCacheManager:
    if isinstance(spec, EncoderOnlyAttentionSpec):
        return EncoderOnlyManager(spec, block_pool, group_id, hash_block_size, enable_caching)
    if isinstance(spec, MambaSpec):
        manager_cls = MambaCheckpointManager if spec.checkpoints else MambaManager
        return manager_cls(spec, block_pool, group_id, hash_block_size, enable_caching)
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, block_pool, group_id, hash_block_size, enable_caching)
    if isinstance(spec, FullAttentionSpec):
        return FullAttentionManager(spec, block_pool, group_id, hash_block_size, enable_caching)
    raise ValueError(f"no KV cache manager for {type(spec).__name__}")
