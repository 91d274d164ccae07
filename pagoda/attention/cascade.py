"""Cascade attention planning: which requests of a step share leading KV blocks, and whether
splitting their attention into one shared prefix pass plus per-request suffix passes pays.

Prefix caching hands requests with the same leading tokens (a system prompt, few-shot examples,
the n samples of one prompt) the same physical blocks. Plain paged attention still reads those
blocks once per request every decode step; the cascade reads them once per group.

Grouping, per KV-cache group and step: a request is a candidate when its first block is a real
(non-null) block and at least one whole block lies before its first query token (every query of
it then sees the whole prefix). Candidates are grouped by their first block id; a group's prefix
is the longest run of leading block ids common to all its members, cut to the whole blocks every
member has computed before this step. Requests that share a system prompt but branch later
(different few-shot sets) form one group over the common part. A group cascades when it pays:
`prefix tokens x members >= CASCADE_MIN_SHARED_TOKENS` (the prefix KV reads it saves, against a
fixed cost of two extra launches and a merge per layer); at most MAX_CASCADE_GROUPS groups, the
largest savings first. A sliding-window group cascades only requests whose every key is still
inside the window (seq_len <= window), so the prefix pass never reads a key a query must not see.

`CascadeBuffers` holds the static, max-size host/device buffers the plan is written into, so a
CUDA graph captured with cascade metadata replays any grouping (groups past the real ones hold
no token; tokens outside every group have group -1).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

from pagoda.attention.metadata import CascadeMetadata
from pagoda.scheduler.block_pool import NULL_BLOCK_ID
from pagoda.worker.cpu_gpu_buffer import CpuGpuBuffer, PackedStaging

# Shared prefix tokens x requests below which a group does not cascade: the break-even of the
# cascade's extra launches and merge against the prefix reads it saves, measured with
# benchmarks/cascade_attention.py on an H200 (2026-12-02, Qwen3-0.6B heads, 64 own keys; see
# benchmarks/RESULTS.md): at 65,536 the cascade wins from 8 requests up (1.28x at 8 x 8,192,
# 1.37x at 32 x 2,048); at 32,768 it loses at every batch size measured.
CASCADE_MIN_SHARED_TOKENS = 65536
# Prefix groups one step cascades at most (a launch constant of the prefix pass's grid).
MAX_CASCADE_GROUPS = 16


class CascadeMode(enum.Enum):
    """What a step's attention metadata may do: OFF plain attention; AUTO cascade the groups that
    pay; ALWAYS cascade metadata even without a group (the dummy batch of a cascade graph)."""

    OFF = 0
    AUTO = 1
    ALWAYS = 2


@dataclass(frozen=True)
class CascadePlan:
    """The groups of one KV-cache group's step: per batch row its group (-1: none), per group
    its prefix length in tokens and its leader row (any member: they hold the same blocks)."""

    req_groups: np.ndarray
    prefix_lens: np.ndarray
    leaders: np.ndarray

    @property
    def num_groups(self) -> int:
        return len(self.prefix_lens)


def plan_cascade(
    block_table: np.ndarray,
    num_computed: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    sliding_window: int | None = None,
    min_shared_tokens: int | None = None,
    max_groups: int = MAX_CASCADE_GROUPS,
) -> CascadePlan | None:
    """The cascade of one step, or None when no group pays.

    block_table [num_reqs, max_blocks] holds each row's block ids; num_computed [num_reqs] the
    tokens each row has in the cache before this step; seq_lens [num_reqs] after it.
    """
    if min_shared_tokens is None:
        min_shared_tokens = CASCADE_MIN_SHARED_TOKENS
    num_reqs = len(num_computed)
    if num_reqs < 2:
        return None
    # Whole blocks every query of the row sees (keys before its first query token).
    visible_blocks = np.minimum(num_computed // block_size, block_table.shape[1]).astype(np.int64)
    eligible = (visible_blocks > 0) & (block_table[:num_reqs, 0] != NULL_BLOCK_ID)
    if sliding_window:
        eligible &= seq_lens <= sliding_window
    rows = np.flatnonzero(eligible)
    if len(rows) < 2:
        return None
    first = block_table[rows, 0]
    _, inverse, counts = np.unique(first, return_inverse=True, return_counts=True)
    shared = counts[inverse] >= 2
    if not shared.any():
        return None
    rows, inverse = rows[shared], inverse[shared]
    order = np.argsort(inverse, kind="stable")
    rows, inverse = rows[order], inverse[order]
    starts = np.flatnonzero(np.r_[True, inverse[1:] != inverse[:-1]])
    leaders = rows[starts]
    leader_of_row = np.repeat(leaders, np.diff(np.r_[starts, len(rows)]))
    # Leading blocks each member shares with its leader, up to its visible blocks (a null block
    # never counts as shared: it is padding or a key dropped outside a window).
    width = int(visible_blocks[rows].max())
    same = (block_table[rows, :width] == block_table[leader_of_row, :width]) & (
        block_table[rows, :width] != NULL_BLOCK_ID
    )
    same &= np.arange(width)[None, :] < visible_blocks[rows, None]
    run = np.where(same.all(1), width, same.argmin(1))
    group_blocks = np.minimum.reduceat(run, starts)
    members = np.diff(np.r_[starts, len(rows)])
    prefix_lens = group_blocks * block_size
    savings = prefix_lens * members
    paying = np.flatnonzero((prefix_lens > 0) & (savings >= min_shared_tokens))
    if len(paying) == 0:
        return None
    paying = paying[np.argsort(-savings[paying], kind="stable")[:max_groups]]
    req_groups = np.full(num_reqs, -1, dtype=np.int32)
    group_of_candidate = np.full(len(starts), -1, dtype=np.int32)
    group_of_candidate[paying] = np.arange(len(paying), dtype=np.int32)
    candidate_of_row = np.repeat(np.arange(len(starts)), members)
    req_groups[rows] = group_of_candidate[candidate_of_row]
    return CascadePlan(req_groups, prefix_lens[paying].astype(np.int32), leaders[paying].astype(np.int32))


class CascadePlanCache:
    """One KV-cache group's last plan, reused while nothing the plan reads has changed.

    A plan reads each row's whole blocks before its first query token and, under a sliding
    window, which rows fit the window. With the same rows in the same places (the block table's
    `layout_version`: appending a block leaves a row's leading ids as they are), the same
    whole-block counts and the same window fits, it is the same plan; so a decode batch plans
    again only when some row's computed tokens cross a block boundary.
    """

    def __init__(self) -> None:
        self._key: tuple[int, bytes, bytes] | None = None
        self._plan: CascadePlan | None = None

    def plan(
        self,
        layout_version: int,
        block_table: np.ndarray,
        num_computed: np.ndarray,
        seq_lens: np.ndarray,
        block_size: int,
        sliding_window: int | None = None,
    ) -> CascadePlan | None:
        """`plan_cascade` of these arguments; `block_table` must be the table `layout_version` counts."""
        fits = seq_lens <= sliding_window if sliding_window else np.empty(0, dtype=bool)
        key = (layout_version, (num_computed // block_size).tobytes(), fits.tobytes())
        if key != self._key:
            self._plan = plan_cascade(block_table, num_computed, seq_lens, block_size, sliding_window)
            self._key = key
        return self._plan


class CascadeBuffers:
    """One KV-cache group's static cascade buffers, sized for `max_tokens` tokens and rows: its
    own, or those `sizes` names carved from the runner's `PackedStaging` (sent with the step's
    other inputs)."""

    def __init__(
        self,
        max_tokens: int,
        device: torch.device,
        pin_memory: bool,
        max_groups: int = MAX_CASCADE_GROUPS,
        staging: PackedStaging | None = None,
        prefix: str = "",
    ) -> None:
        self.max_tokens = max_tokens
        self.max_groups = max_groups
        self._staging = staging
        if staging is None:
            fields = {
                name: CpuGpuBuffer(size, dtype, device, pin_memory)
                for name, (size, dtype) in self.sizes(max_tokens, max_groups).items()
            }
        else:
            fields = {name: staging[prefix + name] for name in self.sizes(max_tokens, max_groups)}
        self.prefix_lens = fields["prefix_lens"]
        self.token_groups = fields["token_groups"]
        self.group_tokens = fields["group_tokens"]
        self.group_token_start = fields["group_token_start"]
        self.group_prefix_lens = fields["group_prefix_lens"]
        self.group_leaders = fields["group_leaders"]

    @staticmethod
    def sizes(
        max_tokens: int, max_groups: int = MAX_CASCADE_GROUPS, prefix: str = ""
    ) -> dict[str, tuple[int, torch.dtype]]:
        """The buffers' (entries, dtype) by name (with `prefix`), for a `PackedStaging` to hold."""
        sizes = {
            "prefix_lens": max_tokens,
            "token_groups": max_tokens,
            "group_tokens": max_tokens,
            "group_token_start": max_groups + 1,
            "group_prefix_lens": max_groups,
            "group_leaders": max_groups,
        }
        return {prefix + name: (size, torch.int32) for name, size in sizes.items()}

    def _send(self, buffer: CpuGpuBuffer, n: int) -> torch.Tensor:
        return buffer.copy_to_gpu(n) if self._staging is None else self._staging.stage(buffer, n)

    def build(
        self, plan: CascadePlan | None, num_scheduled: np.ndarray, num_input_tokens: int, num_rows: int
    ) -> CascadeMetadata:
        """The metadata of `plan` (None: no group, as a captured graph's dummy batch has) for a
        step of `num_input_tokens` tokens (padding included) over `num_rows` rows."""
        if num_input_tokens > self.max_tokens or num_rows > self.max_tokens:
            raise ValueError(
                f"a cascade step takes at most {self.max_tokens} tokens and rows, got {num_input_tokens} / {num_rows}"
            )
        num_reqs = len(num_scheduled)
        total = int(num_scheduled.sum())
        req_groups = plan.req_groups if plan is not None else np.full(num_reqs, -1, dtype=np.int32)
        num_groups = plan.num_groups if plan is not None else 0
        prefix_lens = self.prefix_lens.np
        prefix_lens[:num_rows] = 0
        if plan is not None:
            members = req_groups >= 0
            prefix_lens[:num_reqs][members] = plan.prefix_lens[req_groups[members]]
        token_groups = self.token_groups.np
        token_groups[:total] = np.repeat(req_groups, num_scheduled)
        token_groups[total:num_input_tokens] = -1
        grouped = np.flatnonzero(token_groups[:total] >= 0)
        order = grouped[np.argsort(token_groups[grouped], kind="stable")]
        self.group_tokens.np[: len(order)] = order
        self.group_tokens.np[len(order) : num_input_tokens] = 0
        counts = np.bincount(token_groups[grouped], minlength=self.max_groups)[: self.max_groups]
        self.group_token_start.np[0] = 0
        self.group_token_start.np[1:] = np.cumsum(counts)
        self.group_prefix_lens.np[:] = 0
        self.group_leaders.np[:] = 0
        if plan is not None:
            self.group_prefix_lens.np[:num_groups] = plan.prefix_lens
            self.group_leaders.np[:num_groups] = plan.leaders
        send = self._send
        return CascadeMetadata(
            num_groups=num_groups,
            prefix_lens=send(self.prefix_lens, num_rows),
            token_groups=send(self.token_groups, num_input_tokens),
            group_token_start=send(self.group_token_start, self.max_groups + 1),
            group_tokens=send(self.group_tokens, num_input_tokens),
            group_prefix_lens=send(self.group_prefix_lens, self.max_groups),
            group_leaders=send(self.group_leaders, self.max_groups),
            token_groups_cpu=self.token_groups.cpu[:num_input_tokens],
            prefix_lens_cpu=self.prefix_lens.cpu[:num_rows],
            group_prefix_lens_cpu=self.group_prefix_lens.cpu[: self.max_groups],
            group_leaders_cpu=self.group_leaders.cpu[: self.max_groups],
        )
