"""What each layer keeps in the KV cache, and how the cache is laid out: plain data only.

Every attention (later: state) layer declares a `KVCacheSpec`. Layers with equal specs form a
`KVCacheGroupSpec`; each group gets its own block table, but all groups draw their blocks from
one pool (the hybrid-allocator idea): the cache is a list of `KVCacheTensor`s of `num_blocks`
pages each, and tensor i is shared by the i-th layer of every group. A block id then names
one page in every tensor and belongs to one group at a time, so a sliding-window group that
holds few blocks per request leaves the rest of the pool to the full-attention groups.

Sharing a tensor needs equal page sizes across groups. `unify_page_sizes` scales the block
size of specs with smaller pages until their pages match the largest one (a state layer's
page, megabytes per request, then sets the token granularity of the attention groups).

This module is a leaf (torch only), so the scheduler, executor and runner can all read it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

# The element type of an FP8 KV cache (`CacheConfig.kv_cache_dtype="fp8"`): K / k_scale and
# V / v_scale in e4m3, half the bytes of a 16-bit cache, so the same pool holds twice the tokens.
FP8_KV_DTYPE = torch.float8_e4m3fn


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type: the model's for "auto", e4m3 for "fp8"."""
    return FP8_KV_DTYPE if kv_cache_dtype == "fp8" else model_dtype


def is_fp8_kv_cache(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == FP8_KV_DTYPE


@dataclass(frozen=True)
class KVCacheSpec:
    """One layer's cache: `block_size` tokens per block, `page_size_bytes` per block."""

    block_size: int

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError

    def with_block_size(self, block_size: int) -> KVCacheSpec:
        return dataclasses.replace(self, block_size=block_size)

    def max_blocks_per_request(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of up to `num_tokens` tokens, computed in chunks of at most
        `max_chunk` tokens, holds at once."""
        raise NotImplementedError


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """K and V of `num_kv_heads` heads of `head_size` per token (this rank's heads)."""

    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_size * element


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Every token attends every earlier token: a request holds a block per block_size tokens."""

    def max_blocks_per_request(self, num_tokens: int, max_chunk: int) -> int:
        return -(num_tokens // -self.block_size)


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """A token attends the `sliding_window` latest tokens (itself included), so blocks wholly
    before the window of a request's next token can go back to the pool."""

    sliding_window: int

    def __post_init__(self) -> None:
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    def max_blocks_per_request(self, num_tokens: int, max_chunk: int) -> int:
        # A chunk of C tokens reads the window before its first token too: window - 1 + C keys,
        # which may straddle one more block boundary than they fill.
        full = -(num_tokens // -self.block_size)
        return min(full, -((self.sliding_window - 1 + max_chunk) // -self.block_size) + 1)


@dataclass(frozen=True)
class EncoderOnlyAttentionSpec(AttentionSpec):
    """Bidirectional attention over a request's own tokens, all computed in one step (BERT):
    nothing is kept between steps, so the layer holds no pages and a request no blocks. Its
    group still gets the step's metadata (which tokens are whose)."""

    @property
    def page_size_bytes(self) -> int:
        return 0

    def max_blocks_per_request(self, num_tokens: int, max_chunk: int) -> int:
        return 0


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """A state-space layer's recurrent state: per request one page holding its conv state
    ([conv_dim, conv_kernel - 1], the last inputs of the causal conv) and SSM state ([heads,
    head_dim, state_size]), both in `dtype`, whatever the request's length. So a request holds
    exactly one block of the group; `block_size` only sets the hashing granularity (with
    `checkpoints`, the interval between the states it keeps, see below).

    In a hybrid model the page shares buffers with attention pages, which an attention cache
    lays out as `regions` = 2 (K of every block, then V of every block): a block's page is then
    two strips, and the state sits in the first. `page_size_padded` (bytes) is the page rounded
    up to hold it there and to a multiple of the attention pages (see `pad_state_pages`)."""

    conv_shape: tuple[int, int]
    ssm_shape: tuple[int, int, int]
    dtype: torch.dtype
    page_size_padded: int | None = None
    regions: int = 1
    # mamba_cache_mode "align": block i of a request keeps the state after (i + 1) * block_size
    # tokens (a checkpoint), the block of its latest token the running state.
    checkpoints: bool = False

    @property
    def num_elements(self) -> tuple[int, int]:
        """Elements of (conv state, SSM state) in a page."""
        return self.conv_shape[0] * self.conv_shape[1], self.ssm_shape[0] * self.ssm_shape[1] * self.ssm_shape[2]

    @property
    def state_bytes(self) -> int:
        return sum(self.num_elements) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded or self.state_bytes

    def cache_shape(self, num_blocks: int) -> tuple[int, int, int]:
        """[regions, num_blocks, strip elements], blocks on dim 1 as in an attention cache (the
        block zeroer treats both alike); the layer views its two states in region 0."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return (self.regions, num_blocks, self.page_size_bytes // element // self.regions)

    def max_blocks_per_request(self, num_tokens: int, max_chunk: int) -> int:
        """One; with checkpoints, the block a step reads its state from and the one it writes
        (a step never crosses a block boundary)."""
        return min(2, -(num_tokens // -self.block_size)) if self.checkpoints else 1


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share a spec, and so a block table."""

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec


@dataclass(frozen=True)
class KVCacheTensor:
    """One buffer of `size_bytes` (num_blocks pages); the named layers (one per group) view it."""

    size_bytes: int
    shared_by: tuple[str, ...]


@dataclass(frozen=True)
class KVCacheConfig:
    """The whole cache of one rank: how many blocks the pool has, the groups, the buffers."""

    num_blocks: int
    kv_cache_tensors: tuple[KVCacheTensor, ...]
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(group.kv_cache_spec.block_size for group in self.kv_cache_groups)

    @property
    def group_specs(self) -> tuple[KVCacheSpec, ...]:
        return tuple(group.kv_cache_spec for group in self.kv_cache_groups)

    def max_blocks_per_request(self, num_tokens: int, max_chunk: int) -> int:
        """Pool blocks one request may hold at once across all groups (see KVCacheSpec)."""
        return sum(spec.max_blocks_per_request(num_tokens, max_chunk) for spec in self.group_specs)

    def describe(self) -> list[str]:
        """One line per group (for the startup log): its spec, layers, blocks and tokens."""
        lines = []
        for gid, group in enumerate(self.kv_cache_groups):
            spec = group.kv_cache_spec
            if not spec.page_size_bytes:
                lines.append(f"group {gid}: {type(spec).__name__}, {len(group.layer_names)} layers, no KV cache kept")
                continue
            if isinstance(spec, MambaSpec):
                lines.append(
                    f"group {gid}: MambaSpec, {len(group.layer_names)} layers ({', '.join(group.layer_names[:3])}"
                    f"{', ...' if len(group.layer_names) > 3 else ''}), one {spec.state_bytes}-byte state per request, "
                    f"up to {self.num_blocks - 1} requests"
                )
                continue
            window = f", window {spec.sliding_window}" if isinstance(spec, SlidingWindowSpec) else ""
            lines.append(
                f"group {gid}: {type(spec).__name__}{window}, block size {spec.block_size}, "
                f"{len(group.layer_names)} layers ({', '.join(group.layer_names[:3])}"
                f"{', ...' if len(group.layer_names) > 3 else ''}), up to {self.num_blocks - 1} blocks = "
                f"{(self.num_blocks - 1) * spec.block_size} tokens"
            )
        return lines


# Strips of an attention cache's page (K, V) in the shared buffers.
ATTENTION_PAGE_REGIONS = 2


def pad_state_pages(specs: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Lay each state page (MambaSpec) out like the attention pages beside it: the state in the
    first of the attention cache's two strips, the page a multiple of the largest attention
    page, so that `unify_page_sizes` can scale the attention block size to it. (Half of a
    hybrid's state page is then unused: the price of the K-then-V attention layout.)"""
    attention_pages = [spec.page_size_bytes for spec in specs.values() if not isinstance(spec, MambaSpec)]
    if not attention_pages:
        return specs
    unit = max(attention_pages)
    padded = {}
    for name, spec in specs.items():
        if isinstance(spec, MambaSpec):
            size = -(ATTENTION_PAGE_REGIONS * spec.state_bytes // -unit) * unit
            spec = dataclasses.replace(spec, page_size_padded=size, regions=ATTENTION_PAGE_REGIONS)
        padded[name] = spec
    return padded


def align_checkpoint_blocks(specs: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """State checkpoints every attention block (of the largest, after `unify_page_sizes`), so a
    prefix hit ends where every group can resume from."""
    attention_blocks = [spec.block_size for spec in specs.values() if not isinstance(spec, MambaSpec)]
    if not attention_blocks:
        return specs
    block = max(attention_blocks)
    return {
        name: spec.with_block_size(block) if isinstance(spec, MambaSpec) and spec.checkpoints else spec
        for name, spec in specs.items()
    }


def unify_page_sizes(specs: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Scale block sizes so that every spec's page is as large as the largest page.

    Raises ValueError when a page does not divide the largest one (no block size fits)."""
    largest = max(spec.page_size_bytes for spec in specs.values())
    unified = {}
    for name, spec in specs.items():
        page = spec.page_size_bytes
        if largest % page:
            raise ValueError(
                f"layer {name!r}: its KV page of {page} bytes does not divide the largest page ({largest} bytes)"
            )
        unified[name] = spec if page == largest else spec.with_block_size(spec.block_size * (largest // page))
    return unified


def group_layers(specs: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Layers of equal spec, in model order, cut into groups of equal size (the smallest
    count of layers of one spec), so that every group has about as many layers as there are
    shared tensors; the last group of a spec may be shorter."""
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in specs.items():
        by_spec.setdefault(spec, []).append(name)
    group_size = min(len(names) for names in by_spec.values())
    # Close counts (e.g. 13 sliding and 14 full layers) are better as one group each than
    # as 13 + 1: a one-layer group would waste its pages in every other tensor.
    largest = max(len(names) for names in by_spec.values())
    if largest * 2 < group_size * 3:
        group_size = largest
    groups = []
    for spec, names in by_spec.items():
        for start in range(0, len(names), group_size):
            groups.append(KVCacheGroupSpec(tuple(names[start : start + group_size]), spec))
    return groups


def get_kv_cache_config(
    specs: dict[str, KVCacheSpec], available_bytes: int, num_blocks: int | None = None
) -> KVCacheConfig:
    """The cache for `specs` ({layer name: spec}) within `available_bytes`, or with exactly
    `num_blocks` blocks when given. Block 0 of the pool is the null block."""
    if not specs:
        raise ValueError("the model declares no KV cache layer")
    paged = {name: spec for name, spec in specs.items() if spec.page_size_bytes}
    if not paged:  # encoder-only: groups for the metadata, no buffer; the pool's one block is never taken
        return KVCacheConfig(num_blocks=2, kv_cache_tensors=(), kv_cache_groups=tuple(group_layers(specs)))
    paged = align_checkpoint_blocks(unify_page_sizes(pad_state_pages(paged)))
    specs = {**specs, **paged}
    groups = group_layers(specs)
    page_size = next(iter(paged.values())).page_size_bytes
    num_tensors = max(len(group.layer_names) for group in groups if group.kv_cache_spec.page_size_bytes)
    if num_blocks is None:
        num_blocks = available_bytes // (page_size * num_tensors)
    tensors = tuple(
        KVCacheTensor(
            size_bytes=page_size * num_blocks,
            shared_by=tuple(
                group.layer_names[i]
                for group in groups
                if i < len(group.layer_names) and group.kv_cache_spec.page_size_bytes
            ),
        )
        for i in range(num_tensors)
    )
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=tuple(groups))
