"""`KVCacheManager`: which KV blocks each request holds in every KV-cache group, and the prefix
cache over them.

It coordinates one `SingleTypeKVCacheManager` per group of the `KVCacheConfig` (full attention,
sliding window, ...) over one shared `BlockPool`: an allocation succeeds for all groups or
changes nothing, a prefix-cache hit is the longest prefix every group can resume from, and
freeing, caching and the idle check run per group.

A block hash is sha256 over a canonical byte encoding of (parent hash, the block's token
ids, extra keys), so equal hashes mean equal prefixes; the request's `cache_salt` and its LoRA
adapter are extra keys, so tenants with different salts, and different adapters, never share
blocks. Requests are hashed in blocks
of `hash_block_size` tokens (the gcd of the groups' block sizes); a group with larger blocks
keys its block by the hash that ends at the block's last token. Only full blocks are hashed,
and a block is registered in the cache only once its tokens have been computed.
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
from collections.abc import Sequence

from pagoda.kv_cache_interface import KVCacheConfig, MambaSpec
from pagoda.multimodal.hashing import block_mm_keys
from pagoda.scheduler.block_pool import BlockHash, BlockPool, KVCacheBlock
from pagoda.scheduler.output import BlockIds
from pagoda.scheduler.request import Request
from pagoda.scheduler.single_type_kv_cache_manager import SingleTypeKVCacheManager, make_manager

logger = logging.getLogger(__name__)

# Parent hash of a request's first block.
ROOT_BLOCK_HASH: BlockHash = hashlib.sha256(b"pagoda-prefix-cache-root").digest()

# Prefix-cache hits per group, as `get_computed_blocks` returns them.
GroupBlocks = tuple[list[KVCacheBlock], ...]


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int], extra_keys: bytes = b"") -> BlockHash:
    """sha256 of parent hash (32 bytes), length-prefixed extra keys and int64 token ids."""
    return _hash_packed(parent_hash, _keys_header(extra_keys), struct.pack(f"<{len(token_ids)}q", *token_ids))


def _keys_header(extra_keys: bytes) -> bytes:
    return struct.pack("<I", len(extra_keys)) + extra_keys


def _hash_packed(parent_hash: BlockHash, keys_header: bytes, packed_token_ids: bytes) -> BlockHash:
    """`hash_block_tokens` of tokens already packed as int64, with the extra keys' header."""
    return hashlib.sha256(b"".join((parent_hash, keys_header, packed_token_ids))).digest()


def block_extra_keys(request: Request) -> bytes:
    """What beside the tokens keys a request's blocks: its `cache_salt` and its LoRA adapter
    (an adapter changes every layer's keys and values), each tagged and length-prefixed so no
    salt can forge an adapter's key."""
    if not request.cache_salt and request.lora_request is None:
        return b""
    keys = [(b"salt", request.cache_salt.encode())] if request.cache_salt else []
    if request.lora_request is not None:
        keys.append((b"lora", request.lora_request.cache_key()))
    return b"".join(tag + struct.pack("<I", len(value)) + value for tag, value in keys)


def prefix_caching_unsupported(kv_cache_config: KVCacheConfig) -> str | None:
    """Why no prefix can hit in this layout, or None. A hit must resume every group, and a state
    group keeps only the state after a request's latest token (no checkpoints at block
    boundaries), so a model with one caches nothing."""
    state_layers = [
        name
        for group in kv_cache_config.kv_cache_groups
        if isinstance(group.kv_cache_spec, MambaSpec) and not group.kv_cache_spec.checkpoints
        for name in group.layer_names
    ]
    if not state_layers:
        return None
    return (
        f"{len(state_layers)} state-space layers ({state_layers[0]}, ...) keep one recurrent state per request, "
        "with no checkpoint at block boundaries to resume a cached prefix from (mamba_cache_mode 'align' keeps them)"
    )


class KVCacheManager:
    def __init__(self, kv_cache_config: KVCacheConfig, enable_caching: bool = True) -> None:
        self.kv_cache_config = kv_cache_config
        reason = prefix_caching_unsupported(kv_cache_config)
        if enable_caching and reason is not None:
            logger.warning("prefix caching is off: %s", reason)
            enable_caching = False
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(kv_cache_config.num_blocks)
        block_sizes = kv_cache_config.block_sizes
        self.hash_block_size = math.gcd(*block_sizes)
        # Hits must end where every group's blocks end.
        self.hit_alignment = math.lcm(*block_sizes)
        self.managers: list[SingleTypeKVCacheManager] = [
            make_manager(group.kv_cache_spec, self.block_pool, gid, self.hash_block_size, enable_caching)
            for gid, group in enumerate(kv_cache_config.kv_cache_groups)
        ]
        # Tokens between state checkpoints (0: no state group keeps them).
        self._checkpoint_interval = next(
            (
                spec.block_size
                for spec in kv_cache_config.group_specs
                if isinstance(spec, MambaSpec) and spec.checkpoints
            ),
            0,
        )
        # Whether a request's blocks may change as its tokens advance (a group frees skipped ones).
        self._frees_skipped_blocks = any(manager.frees_skipped_blocks for manager in self.managers)
        # Prefix-cache lookups, in tokens, counted once per admission of a request.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def has_checkpoints(self) -> bool:
        """Whether a state group keeps checkpoints, at which `cap_at_checkpoint` ends steps."""
        return bool(self._checkpoint_interval)

    def cap_at_checkpoint(self, num_computed_tokens: int, num_new_tokens: int) -> int:
        """`num_new_tokens`, cut so that the step ends at the next state checkpoint if it reaches
        one (a state group with checkpoints keeps the state only where steps end)."""
        if not self._checkpoint_interval:
            return num_new_tokens
        return min(num_new_tokens, self._checkpoint_interval - num_computed_tokens % self._checkpoint_interval)

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def max_blocks_per_request(self, num_tokens: int, max_chunk: int) -> int:
        """Pool blocks one request of up to `num_tokens` tokens, computed in chunks of at most
        `max_chunk` tokens, may hold at once across all groups."""
        return self.kv_cache_config.max_blocks_per_request(num_tokens, max_chunk)

    def update_block_hashes(self, request: Request) -> None:
        """Hash the request's full blocks that have no hash yet (call after tokens arrive).

        The new blocks' tokens are packed in one call (a long prompt's hundreds of blocks, each
        otherwise packed on its own, cost most of adding a request)."""
        if not self.enable_caching:
            return
        hashes = request.block_hashes
        size = self.hash_block_size
        first = len(hashes)
        num_full = request.num_tokens // size
        if first == num_full:
            return
        extra_keys = block_extra_keys(request)
        header = _keys_header(extra_keys)
        packed = struct.pack(f"<{(num_full - first) * size}q", *request.all_token_ids[first * size : num_full * size])
        block_bytes = 8 * size
        parent = hashes[-1] if hashes else ROOT_BLOCK_HASH
        for i in range(first, num_full):
            keys_header = header
            if request.mm_features:  # the images whose placeholders the block covers, tagged like the others
                images = block_mm_keys(request.mm_features, i * size, (i + 1) * size)
                keys_header = _keys_header(extra_keys + b"mm" + struct.pack("<I", len(images)) + images)
            start = (i - first) * block_bytes
            parent = _hash_packed(parent, keys_header, packed[start : start + block_bytes])
            hashes.append(parent)

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """The longest cached prefix of a request being admitted: (blocks per group, tokens).

        At most `num_tokens - 1` tokens may hit, so the last one is recomputed and there is a
        position to sample from. Each group proposes its longest hit within the current bound
        and the bound drops to the shortest, until every group agrees.
        """
        no_hit = tuple([] for _ in self.managers)
        if not self.enable_caching:
            return no_hit, 0
        hashes = request.block_hashes
        length = (request.num_tokens - 1) // self.hit_alignment * self.hit_alignment
        while True:
            hits = tuple(manager.find_longest_cache_hit(hashes, length) for manager in self.managers)
            shortest = min(
                len(blocks) * manager.block_size for blocks, manager in zip(hits, self.managers, strict=True)
            )
            shortest = shortest // self.hit_alignment * self.hit_alignment
            if shortest == length:
                return hits, length
            length = shortest

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: GroupBlocks | None = None
    ) -> BlockIds | None:
        """Give the request blocks for `num_new_tokens` more tokens; return the new block ids
        per group.

        Blocks no future token reads (outside a sliding window) go back to the pool first.
        `new_computed_blocks` are prefix-cache hits from `get_computed_blocks`, passed when the
        request is admitted; they count as computed, before the new tokens. Returns None,
        changing nothing but the freeing, when the pool has too few free blocks.
        """
        req_id = request.request_id
        if new_computed_blocks is None and self.holds_tokens(request, request.num_computed_tokens + num_new_tokens):
            return tuple([] for _ in self.managers)
        hits = new_computed_blocks or tuple([] for _ in self.managers)
        num_hit_tokens = len(hits[0]) * self.managers[0].block_size
        num_tokens = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        for manager in self.managers:
            manager.remove_skipped_blocks(req_id, request.block_hashes, request.num_computed_tokens)
        num_needed = sum(
            manager.num_blocks_to_allocate(req_id, num_tokens, blocks)
            for manager, blocks in zip(self.managers, hits, strict=True)
        )
        if num_needed > self.block_pool.num_free_blocks:
            return None
        admitted = req_id not in self.managers[0].req_to_blocks
        if admitted and self.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens
        # Take every group's hits before any group takes new blocks: a hit may sit free in the
        # queue, and a new block for one group must not evict (and reuse) another group's hit.
        for manager, blocks in zip(self.managers, hits, strict=True):
            manager.save_new_computed_blocks(req_id, blocks)
        return tuple(
            [block.block_id for block in manager.allocate_new_blocks(req_id, num_tokens)] for manager in self.managers
        )

    def holds_tokens(self, request: Request, num_tokens: int) -> bool:
        """True when a running request's blocks already hold `num_tokens` tokens in every group
        and no group lets blocks go as tokens advance: allocating would change nothing (the
        common decode step, whose current block still has room)."""
        if self._frees_skipped_blocks:
            return False
        req_id = request.request_id
        return all(manager.holds_tokens(req_id, num_tokens) for manager in self.managers)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that `num_computed_tokens` computed tokens fill."""
        if not self.enable_caching:
            return
        for manager in self.managers:
            manager.cache_blocks(request.request_id, request.block_hashes, num_computed_tokens)

    def free(self, request: Request) -> None:
        for manager in self.managers:
            manager.free(request.request_id)

    def detach(self, request: Request) -> GroupBlocks:
        """Take the request's blocks away from it without freeing them (a transfer still uses
        them); `free_detached` returns them to the pool later."""
        detached = []
        for manager in self.managers:
            detached.append(manager.req_to_blocks.pop(request.request_id, []))
            manager.num_cached_blocks.pop(request.request_id, None)
        return tuple(detached)

    def free_detached(self, blocks: GroupBlocks) -> None:
        for group_blocks in blocks:
            self.block_pool.free_blocks(reversed(group_blocks))

    def num_cached_blocks(self, request: Request) -> int:
        """Leading blocks of the request's first group registered in the prefix cache."""
        return self.managers[0].num_cached_blocks.get(request.request_id, 0)

    def get_block_ids(self, request: Request) -> BlockIds:
        """The request's block ids per group (null blocks where a window let blocks go)."""
        return tuple(manager.block_ids(request.request_id) for manager in self.managers)

    def num_held_blocks(self, request: Request) -> list[int]:
        """Real (non-null) blocks the request holds in each group."""
        null = self.block_pool.null_block
        return [
            sum(1 for block in manager.req_to_blocks.get(request.request_id, ()) if block is not null)
            for manager in self.managers
        ]

    def take_freed_block_ids(self) -> list[int]:
        """Block ids whose content became garbage since the last call (for the block zeroer)."""
        return self.block_pool.take_freed_block_ids()

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()

    def check_idle(self) -> None:
        """Raise AssertionError unless no request holds blocks in any group and the pool is whole."""
        for gid, manager in enumerate(self.managers):
            if manager.req_to_blocks:
                raise AssertionError(
                    f"requests {sorted(manager.req_to_blocks)[:16]} still hold KV blocks in group {gid}"
                )
        self.block_pool.check_idle()
