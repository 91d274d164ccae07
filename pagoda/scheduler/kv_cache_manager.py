"""`KVCacheManager`: which KV blocks each request holds, and the prefix cache over them.

A block hash is sha256 over a canonical byte encoding of (parent hash, the block's token
ids, extra keys), so equal hashes mean equal prefixes; the request's `cache_salt` is an
extra key, so tenants with different salts never share blocks. Only full blocks are
hashed, and a block is registered in the cache only once its tokens have been computed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from pagoda.scheduler.block_pool import BlockHash, BlockPool, KVCacheBlock
from pagoda.scheduler.request import Request

# Parent hash of a request's first block.
ROOT_BLOCK_HASH: BlockHash = hashlib.sha256(b"pagoda-prefix-cache-root").digest()


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int], extra_keys: bytes = b"") -> BlockHash:
    """sha256 of parent hash (32 bytes), length-prefixed extra keys and int64 token ids."""
    payload = b"".join(
        (
            parent_hash,
            struct.pack("<I", len(extra_keys)),
            extra_keys,
            struct.pack(f"<{len(token_ids)}q", *token_ids),
        )
    )
    return hashlib.sha256(payload).digest()


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks)
        self._req_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        # Prefix-cache lookups, in tokens, counted once per admission of a request.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        return _cdiv(num_tokens, self.block_size)

    def update_block_hashes(self, request: Request) -> None:
        """Hash the request's full blocks that have no hash yet (call after tokens arrive)."""
        if not self.enable_caching:
            return
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        if len(hashes) == num_full:
            return
        extra_keys = request.cache_salt.encode() if request.cache_salt else b""
        tokens = request.all_token_ids
        size = self.block_size
        parent = hashes[-1] if hashes else ROOT_BLOCK_HASH
        for i in range(len(hashes), num_full):
            parent = hash_block_tokens(parent, tokens[i * size : (i + 1) * size], extra_keys)
            hashes.append(parent)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of a request being admitted: (blocks, number of tokens).

        At most `num_tokens - 1` tokens may hit, so the last one is recomputed and there is a
        position to sample from; hits are whole blocks.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVCacheBlock] = ()
    ) -> list[int] | None:
        """Give the request blocks for `num_new_tokens` more tokens; return the new block ids.

        `new_computed_blocks` are prefix-cache hits from `get_computed_blocks`, passed when
        the request is admitted; they count as computed, before the new tokens. Returns None,
        changing nothing, when the pool has too few free blocks.
        """
        req_id = request.request_id
        held = self._req_blocks.get(req_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_needed = self.num_blocks_for(num_computed + num_new_tokens) - len(held) - len(new_computed_blocks)
        # Hits on free blocks take them out of the free queue too.
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_needed + num_free_hits > self.block_pool.num_free_blocks:
            return None

        if req_id not in self._req_blocks:
            self._req_blocks[req_id] = held
            self._num_cached_blocks[req_id] = len(new_computed_blocks)
            if self.enable_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(new_computed_blocks) * self.block_size
        self.block_pool.touch(new_computed_blocks)
        held.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_needed)
        held.extend(new_blocks)
        return [block.block_id for block in new_blocks]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that `num_computed_tokens` computed tokens fill."""
        if not self.enable_caching:
            return
        req_id = request.request_id
        blocks = self._req_blocks.get(req_id)
        if blocks is None:
            return
        start = self._num_cached_blocks[req_id]
        end = min(num_computed_tokens // self.block_size, len(request.block_hashes), len(blocks))
        for i in range(start, end):
            self.block_pool.cache_block(blocks[i], request.block_hashes[i])
        self._num_cached_blocks[req_id] = max(start, end)

    def free(self, request: Request) -> None:
        """Return the request's blocks, tail first, so its prefix stays cached longest."""
        blocks = self._req_blocks.pop(request.request_id, None)
        if blocks is None:
            return
        del self._num_cached_blocks[request.request_id]
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request: Request) -> list[int]:
        return [block.block_id for block in self._req_blocks.get(request.request_id, ())]

    def take_freed_block_ids(self) -> list[int]:
        """Block ids whose content became garbage since the last call (for the block zeroer)."""
        return self.block_pool.take_freed_block_ids()

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()

    def check_idle(self) -> None:
        """Raise AssertionError unless no request holds blocks and the pool is whole."""
        if self._req_blocks:
            raise AssertionError(f"requests {sorted(self._req_blocks)[:16]} still hold KV blocks")
        self.block_pool.check_idle()
