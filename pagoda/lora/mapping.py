"""`LoRABatchIndex`: the step's adapter slot per token, in persistent device tensors.

The runner fills it each step before the forward; the LoRA layers read it. The tensors keep
their addresses, so a CUDA graph captured once replays with any mix of adapters. The kernels'
work comes as tiles of up to TILE_TOKENS tokens of one slot: a step of T tokens has at most
cdiv(T, TILE_TOKENS) + max_loras of them (each slot's last tile may be partial), so a grid of
that many rows covers any mix; rows past the step's tiles have slot -1 and return at once.
"""

from __future__ import annotations

import numpy as np
import torch

from pagoda.worker.cpu_gpu_buffer import CpuGpuBuffer

NO_SLOT = -1
# Tokens per kernel tile (the kernels' BLOCK_M).
TILE_TOKENS = 32


def max_tiles(num_tokens: int, max_loras: int) -> int:
    """Tiles a step of `num_tokens` tokens may have: the kernels' grid rows."""
    return -(num_tokens // -TILE_TOKENS) + max_loras


class LoRABatchIndex:
    def __init__(self, max_num_tokens: int, max_loras: int, device: torch.device, pin_memory: bool) -> None:
        self.max_loras = max_loras
        # Per token of the step (padding included): its slot, or -1 (the base model alone).
        self.token_slots = CpuGpuBuffer(max_num_tokens, torch.int32, device, pin_memory)
        self.token_slots.gpu.fill_(NO_SLOT)
        # The step's tokens that have an adapter, grouped by slot (each slot's segment in order).
        self.sorted_tokens = CpuGpuBuffer(max_num_tokens, torch.int32, device, pin_memory)
        # Per tile, (slot, its first and end entry of sorted_tokens); slot -1 past the step's tiles.
        self._tiles = CpuGpuBuffer(3 * max_tiles(max_num_tokens, max_loras), torch.int32, device, pin_memory)
        self.tiles = self._tiles.gpu.view(-1, 3)
        self.tiles[:, 0] = NO_SLOT
        # Slots with tokens this step (host side: the torch path loops over them).
        self.active_slots: tuple[int, ...] = ()

    def set_batch(self, row_slots: np.ndarray, num_scheduled: np.ndarray, num_input_tokens: int) -> None:
        """`row_slots[i]`: the slot of batch row i (-1: none), which runs `num_scheduled[i]` tokens."""
        total = int(num_scheduled.sum())
        slots = np.repeat(row_slots.astype(np.int32), num_scheduled)
        self.token_slots.np[:total] = slots
        self.token_slots.np[total:num_input_tokens] = NO_SLOT
        with_adapter = np.flatnonzero(slots >= 0)
        order = with_adapter[np.argsort(slots[with_adapter], kind="stable")]
        self.sorted_tokens.np[: len(order)] = order
        counts = np.bincount(slots[with_adapter], minlength=self.max_loras)
        ends = np.cumsum(counts)
        active = np.flatnonzero(counts)
        self.active_slots = tuple(active.tolist())
        # Each active slot's segment cut into tiles.
        num_tiles = -(counts[active] // -TILE_TOKENS)
        tile_slots = np.repeat(active, num_tiles)
        within = np.arange(len(tile_slots)) - np.repeat(np.cumsum(num_tiles) - num_tiles, num_tiles)
        grid_rows = max_tiles(num_input_tokens, self.max_loras)
        tiles = self._tiles.np[: 3 * grid_rows].reshape(grid_rows, 3)
        tiles[: len(tile_slots), 0] = tile_slots
        tiles[: len(tile_slots), 1] = ends[tile_slots] - counts[tile_slots] + within * TILE_TOKENS
        tiles[: len(tile_slots), 2] = ends[tile_slots]
        tiles[len(tile_slots) :, 0] = NO_SLOT
        self.token_slots.copy_to_gpu(num_input_tokens)
        self.sorted_tokens.copy_to_gpu(len(order))
        self._tiles.copy_to_gpu(3 * grid_rows)
