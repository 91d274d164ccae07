"""`DraftModelProposer`: a small model with the target's vocabulary drafts k tokens per request.

The draft runs in the runner's process, on its device, beside the target.

KV cache: its attention layers declare their specs like the target's and join the engine's
KV-cache groups (the target's group where the specs are equal, a group of their own where they
differ), so its KV lives in the one pool, sized from the one memory budget, in blocks the
scheduler allocates per request for every group at once. A separate pool would need its own
allocator, preemption and prefix cache; sharing the groups makes preemption, abort and prefix
caching hold for the draft as they hold for the target. A cached block holds the draft's KV of
its tokens too, since the draft runs over every token the target computes (the catch-up), and
the KV of rejected drafts is cached for neither (only blocks below the corrected count are).

One engine step:
1. `catch_up`: the draft's forward over the step's own inputs (prefill chunks, the last token
   and the drafts of a verify row: the same ids, positions and slots), so its KV covers every
   position the target computed, chunked prefills and prefix-cache misses included.
2. `propose`: k one-token forwards draft k tokens for each row that sampled, the first after
   its last emitted token. Where that token sits depends on how many drafts the row accepted,
   which only the device knows yet: the steps' positions, lengths and slots are computed there
   from the emitted counts (the host stages what it knows: each row's position before its
   emitted tokens, its rows and held blocks), so the host queues the draft steps right behind
   the verify step without waiting for it (a backend that plans on the host, the torch
   reference, still waits for the lengths). A draft's KV goes
   into the row's slots past its tokens (the scheduler allocates k lookahead slots; a position
   outside the row's blocks writes nowhere, which only makes that draft worse) and the next
   step's catch-up rewrites those positions with the tokens that were kept.

The one-token steps read static device buffers (ids, positions, lengths, slots, block-table
rows), filled by device copies from the step's staged values, so on CUDA each replays a graph
captured per padded batch size (sharing the target's graph pool), with the LM head and the
draw outside it as in the target's graphs; the catch-up is part of the target's own forward
(and so of its graphs, see `GPUModelRunner._forward`).

Drafts: a greedy row takes the draft's argmax; a sampled row draws with the very Gumbel noise
the target's sampler uses at the same (seed, output position), at the row's temperature, so the
draft matches the target's sample whenever both put the perturbed maximum on the same token.
Top-k/p and penalties are not applied to drafts: they only change how often drafts hold, never
what a request produces, since verification keeps exactly the target's own samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagoda.attention.backends import CUDAGraphSupport
from pagoda.attention.layer import Attention
from pagoda.attention.metadata import AttentionMetadata
from pagoda.config import ModelConfig
from pagoda.forward_context import ForwardContext
from pagoda.sample.metadata import SamplingMetadata
from pagoda.sample.ops import gumbel_max
from pagoda.worker.cpu_gpu_buffer import CpuGpuBuffer
from pagoda.worker.cuda_graph import BatchDescriptor, CudaGraphManager

if TYPE_CHECKING:
    from pagoda.worker.gpu_model_runner import GPUModelRunner, PreparedInputs

# Prepended to the draft's layer names, so its KV-cache views and metadata never collide with the target's.
DRAFT_LAYER_PREFIX = "draft."


class DraftModelProposer:
    def __init__(self, runner: GPUModelRunner, draft_config: ModelConfig, num_speculative_tokens: int) -> None:
        self.runner = runner
        self.draft_config = draft_config
        self.num_speculative_tokens = num_speculative_tokens
        self.model: torch.nn.Module | None = None
        self.layers: list[Attention] = []
        max_rows = runner.max_num_reqs
        # Host-known values of a proposal, staged for the device: each sampled row's position
        # before its emitted tokens, its batch row, the slots its blocks hold per group.
        self.base_positions = runner.buffer(max_rows, torch.int64)
        self.held_slots: dict[int, CpuGpuBuffer] = {}
        self.query_start_loc = runner.buffer(max_rows + 1, torch.int32)
        self.rows = runner.buffer(max_rows, torch.int64)
        self.logits_index = runner.buffer(max_rows, torch.int64)
        # Recorded after a proposal's host-to-device copies: the next one rewrites their pinned
        # sources only once they ran (no host sync waits for the step in between).
        self._staged = torch.cuda.Event() if runner.device.type == "cuda" else None
        self.host_plans = runner.attn_backend.cudagraph_support < CUDAGraphSupport.ALWAYS
        # What each one-token step (and its graph) reads; filled by device copies.
        device = runner.device
        self.input_ids = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.seq_lens_cpu = torch.zeros(max_rows, dtype=torch.int32)  # for backends that plan on the host
        self.slot_mappings: dict[int, torch.Tensor] = {}
        self.block_tables: dict[int, torch.Tensor] = {}
        self.graphs: CudaGraphManager | None = None
        self._contexts: dict[int, ForwardContext] = {}

    # ---- setup ------------------------------------------------------------------------------

    def load_model(self) -> torch.nn.Module:
        from pagoda.model.loader import get_model

        runner = self.runner
        self.model = get_model(self.draft_config, runner.attn_backend, runner.device)
        self.layers = [module for module in self.model.modules() if isinstance(module, Attention)]
        for layer in self.layers:
            layer.layer_name = DRAFT_LAYER_PREFIX + layer.layer_name
        return self.model

    def _groups(self) -> list[int]:
        """The KV-cache groups the draft's layers are in (known once the runner made its groups)."""
        groups = self.runner.layer_groups
        return sorted({groups[layer.layer_name] for layer in self.layers})

    def _context(self, num_rows: int) -> ForwardContext:
        """The one-token steps' forward context over `num_rows` (padded) rows of the static buffers.
        A backend that plans on the host (the torch reference) plans from the values at build:
        its context is built anew for each step."""
        context = self._contexts.get(num_rows)
        if context is not None and context.kv_caches is self.runner.kv_caches and not self.host_plans:
            return context
        runner = self.runner
        batch = runner.input_batch
        group_metadata = {}
        for gid in self._groups():
            if gid not in self.slot_mappings:
                table = batch.block_table[gid].block_table
                self.slot_mappings[gid] = torch.full(
                    (runner.max_num_reqs,), -1, dtype=torch.int64, device=runner.device
                )
                self.block_tables[gid] = torch.zeros_like(table[: runner.max_num_reqs])
            group_metadata[gid] = runner.attn_metadata_builders[gid].build(
                AttentionMetadata(
                    num_reqs=num_rows,
                    num_actual_tokens=num_rows,
                    max_query_len=1,
                    max_seq_len=runner.max_model_len,
                    block_size=batch.block_table.block_sizes[gid],
                    query_start_loc=self.query_start_loc.gpu[: num_rows + 1],
                    seq_lens=self.seq_lens[:num_rows],
                    block_table=self.block_tables[gid][:num_rows],
                    slot_mapping=self.slot_mappings[gid][:num_rows],
                    query_start_loc_cpu=self.query_start_loc.cpu[: num_rows + 1],
                    seq_lens_cpu=self.seq_lens_cpu[:num_rows],
                )
            )
        groups = runner.layer_groups
        context = ForwardContext(
            attn_metadata={layer.layer_name: group_metadata[groups[layer.layer_name]] for layer in self.layers},
            kv_caches=runner.kv_caches,
        )
        self._contexts[num_rows] = context  # its tensors are views of the static buffers
        return context

    def capture_graphs(self, target_graphs: CudaGraphManager) -> None:
        """A graph per decode size of the target's, in the target's pool: one token per row, every
        row of length 1 writing nowhere (slot -1) at capture."""
        assert self.model is not None
        sizes = [size for size in target_graphs.decode_sizes if size <= self.runner.max_num_reqs]
        if not sizes:
            return
        self.graphs = CudaGraphManager(sizes, max(sizes), 0)
        self.graphs.pool = target_graphs.pool
        for key in self.graphs.descriptors:
            size = key.num_tokens
            self.query_start_loc.np[: size + 1] = np.arange(size + 1)
            self.query_start_loc.copy_to_gpu(size + 1)
            self.seq_lens_cpu[:size] = 1
            self.seq_lens[:size] = 1
            self.positions[:size] = 0
            for slots in self.slot_mappings.values():
                slots.fill_(-1)
            context = self._context(size)
            self.graphs.capture(key, lambda size=size, context=context: self._step_forward(size, context))

    # ---- one step ---------------------------------------------------------------------------

    def catch_up(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> None:
        """The draft's KV for every token of the target's step (its outputs are not needed)."""
        assert self.model is not None
        self.model(input_ids, positions, context)

    def propose(
        self,
        inputs: PreparedInputs,
        hidden_states: torch.Tensor,
        token_ids: torch.Tensor | None,
        metadata: SamplingMetadata | None,
    ) -> torch.Tensor | None:
        """[rows, k] int64: k drafts after each sampled row's emitted tokens (`token_ids`, [rows, n],
        -1 past a row's last), drawn as the module docstring says; None when no row sampled."""
        if token_ids is None:
            return None
        assert metadata is not None
        self.begin_staging()
        num_emitted = (token_ids >= 0).sum(dim=1)
        self.input_ids[: len(token_ids)] = token_ids.gather(1, num_emitted[:, None] - 1).squeeze(1)
        drafts = torch.empty((len(token_ids), self.num_speculative_tokens), dtype=torch.int64, device=token_ids.device)
        self._draft_steps(inputs, num_emitted, DraftSettings.of(self, inputs, num_emitted, metadata), drafts, 0)
        self.end_staging()
        return drafts

    def last_logits_rows(self, inputs: PreparedInputs, num_emitted: torch.Tensor) -> torch.Tensor:
        """[rows] on the device: each sampled row's logits row of its last emitted token."""
        num_rows = len(num_emitted)
        self.logits_index.np[:num_rows] = inputs.logits_start - 1
        return self.logits_index.copy_to_gpu(num_rows) + num_emitted

    def begin_staging(self) -> None:
        """Before a proposal writes the pinned staging buffers: the last one's copies have run."""
        if self._staged is not None:
            self._staged.synchronize()

    def end_staging(self) -> None:
        if self._staged is not None:
            self._staged.record()

    def _draft_steps(
        self,
        inputs: PreparedInputs,
        num_emitted: torch.Tensor,
        settings: DraftSettings,
        drafts: torch.Tensor,
        first: int,
    ) -> None:
        """Fill drafts[:, first:] by one-token steps: step j reads `input_ids` (the row's last
        emitted token, then each draft) at j after each row's last emitted token's position.
        num_emitted: [rows] int64 on the device, each sampled row's tokens this step."""
        assert self.model is not None
        num_steps = self.num_speculative_tokens - first
        if num_steps == 0:
            return
        num_rows = len(num_emitted)
        padded = self._padded_rows(num_rows)
        positions, seq_lens, slots = self._stage(inputs, num_emitted, padded, num_steps)
        host_seq_lens = seq_lens.cpu() if self.host_plans else None
        key = BatchDescriptor(padded, True)
        for step in range(num_steps):
            self.positions[:padded].copy_(positions[step])
            self.seq_lens[:padded].copy_(seq_lens[step])
            if host_seq_lens is not None:
                self.seq_lens_cpu[:padded] = host_seq_lens[step]
            for gid, step_slots in slots.items():
                self.slot_mappings[gid][:padded].copy_(step_slots[step])
            if self.graphs is not None and key in self.graphs.graphs:
                hidden_states = self.graphs.replay(key)
            else:
                hidden_states = self._step_forward(padded, self._context(padded))
            sampled = settings.draw(self.model.compute_logits(hidden_states[:num_rows]), first + step)
            drafts[:, first + step] = sampled
            self.input_ids[:num_rows] = sampled

    def _step_forward(self, num_rows: int, context: ForwardContext) -> torch.Tensor:
        """One one-token step over the static buffers' first `num_rows` rows (what a graph records)."""
        assert self.model is not None
        return self.model(self.input_ids[:num_rows], self.positions[:num_rows], context)

    def _padded_rows(self, num_rows: int) -> int:
        """Rows of the one-token steps: the captured graph size that holds them, else exactly them."""
        if self.graphs is not None:
            key = self.graphs.descriptor_for(num_rows, uniform_decode=True)
            if key is not None:
                return key.num_tokens
        return num_rows

    def _stage(
        self, inputs: PreparedInputs, num_emitted: torch.Tensor, padded: int, k: int
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """Positions, lengths and per-group slots of the k one-token steps, [k, padded] each on
        the device: step j's input sits j after each row's last emitted token; padded rows have
        length 0 and write nowhere, as do positions outside a row's blocks or past
        max_model_len (their drafts are only worse)."""
        runner = self.runner
        batch = runner.input_batch
        rows = inputs.sample_rows
        num_rows = len(rows)
        device = num_emitted.device
        self.base_positions.np[:num_rows] = runner.seq_lens.np[rows].astype(np.int64) - inputs.num_drafts - 1
        first = self.base_positions.copy_to_gpu(num_rows) + num_emitted
        positions = torch.zeros((k, padded), dtype=torch.int64, device=device)
        positions[:, :num_rows] = first[None, :] + torch.arange(k, device=device)[:, None]
        real_rows = torch.arange(padded, device=device) < num_rows
        inside = (positions < runner.max_model_len) & real_rows[None, :]
        positions.clamp_(max=runner.max_model_len - 1)
        seq_lens = torch.where(real_rows[None, :], positions + 1, 0).to(torch.int32)
        self.query_start_loc.np[: padded + 1] = np.minimum(np.arange(padded + 1), num_rows)
        self.query_start_loc.copy_to_gpu(padded + 1)
        self.rows.np[:num_rows] = rows
        rows_device = self.rows.copy_to_gpu(num_rows)
        padded_rows = torch.nn.functional.pad(rows_device, (0, padded - num_rows))
        self._context(padded)  # makes the static buffers of the draft's groups
        slots = {}
        for gid in self._groups():
            table, block_size = batch.block_table[gid], batch.block_table.block_sizes[gid]
            held = self.held_slots.get(gid)
            if held is None:
                held = self.held_slots[gid] = runner.buffer(runner.max_num_reqs, torch.int64)
            held.np[:padded] = 0
            held.np[:num_rows] = table.num_blocks_per_row[rows].astype(np.int64) * block_size
            group_slots = table.device_slots(padded_rows[None, :], positions, block_size)
            keep = inside & (positions < held.copy_to_gpu(padded)[None, :])
            slots[gid] = torch.where(keep, group_slots, -1)
            self.block_tables[gid][:num_rows] = table.block_table.index_select(0, rows_device)
        return positions, seq_lens, slots


@dataclass(frozen=True)
class DraftSettings:
    """How each sampled row draws its drafts: its temperature, seed and the output position of
    its last emitted token (from the step's logits rows), and whether every row is greedy."""

    temperature: torch.Tensor
    seeds: torch.Tensor
    output_positions: torch.Tensor
    all_greedy: bool

    @classmethod
    def of(
        cls,
        proposer: DraftModelProposer,
        inputs: PreparedInputs,
        num_emitted: torch.Tensor,
        metadata: SamplingMetadata,
    ) -> DraftSettings:
        index = proposer.last_logits_rows(inputs, num_emitted)
        return cls(
            metadata.temperature.index_select(0, index),
            metadata.seeds.index_select(0, index),
            metadata.output_positions.index_select(0, index),
            metadata.all_greedy,
        )

    def draw(self, logits: torch.Tensor, column: int) -> torch.Tensor:
        """Draft `column` (0-based) of every row: argmax, or the target's Gumbel draw at its position."""
        if self.all_greedy:
            return logits.argmax(dim=-1)
        return gumbel_max(logits, self.temperature, self.seeds, self.output_positions + 1 + column, None)
