"""`LoRABatchIndex`: the step's adapter slot per token, in persistent device tensors.

The runner fills it each step before the forward; the LoRA layers read it. The tensors keep
their addresses, so a CUDA graph captured once replays with any mix of adapters: the kernels'
grids cover every slot and token tile, and a program whose tile has no tokens returns.
"""

from __future__ import annotations

import numpy as np
import torch

from pagoda.worker.cpu_gpu_buffer import CpuGpuBuffer

NO_SLOT = -1


class LoRABatchIndex:
    def __init__(self, max_num_tokens: int, max_loras: int, device: torch.device, pin_memory: bool) -> None:
        self.max_loras = max_loras
        # Per token of the step (padding included): its slot, or -1 (the base model alone).
        self.token_slots = CpuGpuBuffer(max_num_tokens, torch.int32, device, pin_memory)
        self.token_slots.gpu.fill_(NO_SLOT)
        # The step's tokens that have an adapter, grouped by slot; slot s owns entries
        # slot_starts[s] .. slot_starts[s + 1] (the kernels' segments).
        self.sorted_tokens = CpuGpuBuffer(max_num_tokens, torch.int32, device, pin_memory)
        self.slot_starts = CpuGpuBuffer(max_loras + 1, torch.int32, device, pin_memory)
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
        self.slot_starts.np[0] = 0
        np.cumsum(counts, out=self.slot_starts.np[1:])
        self.active_slots = tuple(np.flatnonzero(counts).tolist())
        self.token_slots.copy_to_gpu(num_input_tokens)
        self.sorted_tokens.copy_to_gpu(len(order))
        self.slot_starts.copy_to_gpu(self.max_loras + 1)
