"""The KV block pool: reference counts, the prefix-cache index and an LRU free queue.

Block 0 is the null block: reserved for padding, never handed out and never freed.

Every block with reference count 0 sits in one doubly linked free queue. A block freed
without a cached hash holds nothing reusable, so it goes to the front and is handed out
first; a block freed with a hash goes to the back, so when a fresh block is needed the
least recently freed cached block is evicted. A prefix-cache hit on a free block unlinks
it from the middle. Every queue operation is O(1).

`freed_block_ids` lists blocks whose content stopped being worth anything since it was
last taken (freed uncached, or evicted from the prefix cache): those the runner may zero.
A block freed with a hash keeps its content for a later hit and is reported only when it
is evicted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

BlockHash = bytes

NULL_BLOCK_ID = 0


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block is registered in the prefix cache.
    block_hash: BlockHash | None = None
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not self._tail:
            assert block is not None
            yield block
            block = block.next_free

    def popleft(self) -> KVCacheBlock:
        if self._len == 0:
            raise IndexError("no free KV cache block")
        block = self._head.next_free
        assert block is not None
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        self._link(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._link(block, self._head, self._head.next_free)

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def _link(self, block: KVCacheBlock, prev: KVCacheBlock | None, nxt: KVCacheBlock | None) -> None:
        assert prev is not None and nxt is not None
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self._len += 1


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self._free_queue = FreeBlockQueue(self.blocks[NULL_BLOCK_ID + 1 :])
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        self._freed_block_ids: list[int] = []
        # Told (block id, hash) of each cached block evicted for reuse, while its content is still
        # there for this step (a KV connector saves it).
        self.on_evict: Callable[[int, BlockHash], None] | None = None

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can get: never used, freed, or cached but unreferenced (evictable)."""
        return len(self._free_queue)

    @property
    def usage(self) -> float:
        """Fraction of the usable pool held by requests."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the front of the free queue, evicting cached ones."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} are free")
        blocks = []
        for _ in range(num_blocks):
            block = self._free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (prefix-cache hits), taking free ones out of the queue;
        the null block (where a sliding window let blocks go) is nobody's."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                self._free_queue.remove(block)
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a computed full block under its hash.

        When another block already holds this hash (two requests computed the same prefix
        at once), that block stays the cached one and this one is left uncached.
        """
        if block.block_hash is None and block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the given order (callers pass tail first)."""
        for block in blocks:
            if block is self.null_block:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                continue
            if block.block_hash is None:
                self._free_queue.appendleft(block)
                self._freed_block_ids.append(block.block_id)
            else:
                self._free_queue.append(block)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; blocks in use keep their content but will not be reused."""
        for block in self._cached.values():
            block.block_hash = None
            if block.ref_cnt == 0:
                self._freed_block_ids.append(block.block_id)
        self._cached.clear()

    def take_freed_block_ids(self) -> list[int]:
        freed = list(dict.fromkeys(self._freed_block_ids))
        self._freed_block_ids.clear()
        return freed

    def check_idle(self) -> None:
        """Raise AssertionError unless every usable block is free, unreferenced and consistent."""
        problems = []
        referenced = [b.block_id for b in self.blocks if b.ref_cnt != 0]
        if referenced:
            problems.append(f"blocks {referenced[:16]} still have references")
        queued = [b.block_id for b in self._free_queue]
        if len(queued) != self.num_usable_blocks or len(set(queued)) != len(queued):
            problems.append(f"{len(queued)} blocks in the free queue, expected {self.num_usable_blocks} distinct")
        if NULL_BLOCK_ID in queued:
            problems.append("the null block is in the free queue")
        stale = [h.hex()[:8] for h, b in self._cached.items() if b.block_hash != h]
        if stale:
            problems.append(f"prefix-cache entries {stale[:8]} point at blocks with another hash")
        if problems:
            raise AssertionError("KV block pool not idle: " + "; ".join(problems))

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        if self.on_evict is not None:
            self.on_evict(block.block_id, block.block_hash)
        del self._cached[block.block_hash]
        block.block_hash = None
        self._freed_block_ids.append(block.block_id)
