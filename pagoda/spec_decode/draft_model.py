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
2. `propose`: once verified, the step's tokens reach the host (the one sync: where a row's
   last token sits depends on how many drafts it accepted); then k one-token forwards draft k
   tokens for each row that sampled, the first after its last emitted token. A draft's KV goes
   into the row's slots past its tokens (the scheduler allocates k lookahead slots; a position
   outside the row's blocks writes nowhere, which only makes that draft worse) and the next
   step's catch-up rewrites those positions with the tokens that were kept.

Drafts: a greedy row takes the draft's argmax; a sampled row draws with the very Gumbel noise
the target's sampler uses at the same (seed, output position), at the row's temperature, so the
draft matches the target's sample whenever both put the perturbed maximum on the same token.
Top-k/p and penalties are not applied to drafts: they only change how often drafts hold, never
what a request produces, since verification keeps exactly the target's own samples.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagoda.attention.layer import Attention
from pagoda.attention.metadata import AttentionMetadata
from pagoda.config import ModelConfig
from pagoda.forward_context import ForwardContext
from pagoda.sample.metadata import SamplingMetadata
from pagoda.sample.ops import gumbel_max

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
        size = runner.max_num_reqs * num_speculative_tokens
        # Staging of the k one-token steps' inputs, all filled at once after the sync.
        self.positions = runner.buffer(size, torch.int64)
        self.seq_lens = runner.buffer(size, torch.int32)
        self.query_start_loc = runner.buffer(runner.max_num_reqs + 1, torch.int32)
        self.query_start_loc.np[:] = np.arange(runner.max_num_reqs + 1)
        self.query_start_loc.copy_to_gpu(runner.max_num_reqs + 1)
        self.rows = runner.buffer(runner.max_num_reqs, torch.int64)
        self.logits_index = runner.buffer(runner.max_num_reqs, torch.int64)
        self.slot_mappings: dict[int, object] = {}

    def load_model(self) -> torch.nn.Module:
        from pagoda.model.loader import get_model

        runner = self.runner
        self.model = get_model(self.draft_config, runner.attn_backend, runner.device)
        for layer in self.attention_layers():
            layer.layer_name = DRAFT_LAYER_PREFIX + layer.layer_name
        return self.model

    def attention_layers(self) -> list[Attention]:
        assert self.model is not None
        return [module for module in self.model.modules() if isinstance(module, Attention)]

    def catch_up(self, inputs: PreparedInputs) -> None:
        """The draft's KV for every token of the step (its outputs are not needed)."""
        assert self.model is not None
        self.model(inputs.input_ids, inputs.positions, inputs.forward_context)

    def propose(self, inputs: PreparedInputs, token_ids: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """[rows, k] int64: k drafts after each sampled row's emitted tokens (`token_ids`, [rows, n],
        -1 past a row's last), drawn as the module docstring says."""
        assert self.model is not None
        runner, k = self.runner, self.num_speculative_tokens
        batch = runner.input_batch
        rows = inputs.sample_rows
        num_rows = len(rows)
        num_emitted = (token_ids.cpu().numpy() >= 0).sum(axis=1)
        # Where each row's last emitted token sits: the first one-token step's input.
        first = runner.seq_lens.np[rows].astype(np.int64) - inputs.num_drafts + num_emitted - 1
        positions = first[None, :] + np.arange(k)[:, None]  # [k, rows]
        inside = positions < runner.max_model_len
        positions = np.minimum(positions, runner.max_model_len - 1)
        count = k * num_rows
        self.positions.np[:count] = positions.ravel()
        self.seq_lens.np[:count] = positions.ravel() + 1
        positions_device = self.positions.copy_to_gpu(count).view(k, num_rows)
        seq_lens_device = self.seq_lens.copy_to_gpu(count).view(k, num_rows)
        self.rows.np[:num_rows] = rows
        rows_device = self.rows.copy_to_gpu(num_rows)
        self.logits_index.np[:num_rows] = inputs.logits_start + num_emitted - 1
        logits_index = self.logits_index.copy_to_gpu(num_rows)

        groups = sorted({runner.layer_groups[layer.layer_name] for layer in self.attention_layers()})
        group_inputs = {}
        for gid in groups:
            table, block_size = batch.block_table[gid], batch.block_table.block_sizes[gid]
            slots = table.block_table_np[rows[None, :], positions // block_size].astype(np.int64) * block_size
            slots += positions % block_size
            held = positions < table.num_blocks_per_row[rows][None, :].astype(np.int64) * block_size
            slots[~(held & inside)] = -1
            slot_mapping = self.slot_mappings.get(gid)
            if slot_mapping is None:
                slot_mapping = self.slot_mappings[gid] = runner.buffer(runner.max_num_reqs * k, torch.int64)
            slot_mapping.np[:count] = slots.ravel()
            group_inputs[gid] = (
                table.block_table.index_select(0, rows_device),
                slot_mapping.copy_to_gpu(count).view(k, num_rows),
                block_size,
            )

        # The last emitted token of each row, and its sampling settings (logits rows of the step).
        last = (token_ids >= 0).sum(dim=1, keepdim=True) - 1
        input_ids = token_ids.gather(1, last).squeeze(1)
        temperature = metadata.temperature.index_select(0, logits_index)
        seeds = metadata.seeds.index_select(0, logits_index)
        output_positions = metadata.output_positions.index_select(0, logits_index)
        seq_lens_cpu = self.seq_lens.cpu[:count].view(k, num_rows)
        drafts = torch.empty((num_rows, k), dtype=torch.int64, device=token_ids.device)
        for step in range(k):
            group_metadata = {
                gid: runner.attn_metadata_builders[gid].build(
                    AttentionMetadata(
                        num_reqs=num_rows,
                        num_actual_tokens=num_rows,
                        max_query_len=1,
                        max_seq_len=int(positions[step].max()) + 1,
                        block_size=block_size,
                        query_start_loc=self.query_start_loc.gpu[: num_rows + 1],
                        seq_lens=seq_lens_device[step],
                        block_table=block_table,
                        slot_mapping=slot_mapping[step],
                        query_start_loc_cpu=self.query_start_loc.cpu[: num_rows + 1],
                        seq_lens_cpu=seq_lens_cpu[step],
                    )
                )
                for gid, (block_table, slot_mapping, block_size) in group_inputs.items()
            }
            context = ForwardContext(
                attn_metadata={layer.layer_name: group_metadata[runner.layer_groups[layer.layer_name]]
                               for layer in self.attention_layers()},
                kv_caches=runner.kv_caches,
            )
            hidden_states = self.model(input_ids, positions_device[step], context)
            logits = self.model.compute_logits(hidden_states)
            if metadata.all_greedy:
                input_ids = logits.argmax(dim=-1)
            else:
                input_ids = gumbel_max(logits, temperature, seeds, output_positions + 1 + step, None)
            drafts[:, step] = input_ids
        return drafts
