"""`LoRAManager`: adapters in a fixed number of device slots, least recently used out first.

Each step the runner names the adapters of its rows (the scheduler admits at most `max_loras`
distinct ones at a time); the manager puts each in a slot, evicting the least recently used
adapter that the step does not need, and sets the batch index. Loaded adapters stay in a CPU
cache of `max_cpu_loras` entries (LRU too), so refilling a slot copies from memory instead of
reading the files. Slot writes are queued on the device stream behind the steps still running,
so a slot is never rewritten under a step that reads it.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from pagoda.config import ConfigError, LoRAConfig
from pagoda.lora.layers import LoRALinear, wrap_linear_layers
from pagoda.lora.mapping import NO_SLOT, LoRABatchIndex
from pagoda.lora.peft_loader import PeftAdapter, read_adapter
from pagoda.lora.request import LoRARequest


def slot_rank(max_lora_rank: int) -> int:
    """The slots' rank columns: a power of two, at least 16 (the kernels' smallest tile)."""
    return max(16, 1 << (max_lora_rank - 1).bit_length())


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        lora_config: LoRAConfig,
        hf_config,
        max_num_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
        use_triton: bool,
    ) -> None:
        """`use_triton`: the Triton kernels (on CUDA; interpreted on the CPU), else the torch path."""
        self.config = lora_config
        self.hf_config = hf_config
        self.dtype = dtype
        self.index = LoRABatchIndex(max_num_tokens, lora_config.max_loras, device, device.type == "cuda")
        self.layers: dict[str, LoRALinear] = wrap_linear_layers(
            model, self.index, lora_config.max_loras, slot_rank(lora_config.max_lora_rank), dtype, use_triton
        )
        if not self.layers:
            raise ConfigError(f"enable_lora: {type(model).__name__} has no q/k/v/o/gate/up/down projection to adapt")
        if use_triton:
            from pagoda.lora.triton_ops import expand_block_n

            for layer in self.layers.values():
                try:
                    expand_block_n(tuple(offset for offset, _ in layer.output_slices[1:]))
                except ValueError as error:
                    raise ConfigError(f"enable_lora on this model: {error}") from error
        # Adapter id -> its slot, least recently used first; free slots.
        self._slots: OrderedDict[int, int] = OrderedDict()
        self._free_slots = list(range(lora_config.max_loras))
        self._cpu_cache: OrderedDict[int, PeftAdapter] = OrderedDict()
        # What the tests and logs read: slot fills, and reads of adapter files.
        self.num_slot_loads = 0
        self.num_file_loads = 0

    @property
    def slot_adapters(self) -> dict[int, int]:
        """Adapter id -> slot, for the adapters in device slots now."""
        return dict(self._slots)

    @property
    def nbytes(self) -> int:
        """Device bytes of every layer's slots (allocated with the model: part of its weights)."""
        return sum(layer.lora_a.nbytes + layer.lora_b.nbytes for layer in self.layers.values())

    @property
    def cpu_adapters(self) -> list[int]:
        return list(self._cpu_cache)

    def set_batch(self, row_loras: list[LoRARequest | None], num_scheduled: np.ndarray, num_input_tokens: int) -> None:
        """Put the rows' adapters in slots and set the step's per-token slot index."""
        needed = {lora.lora_int_id: lora for lora in row_loras if lora is not None}
        if len(needed) > self.config.max_loras:
            raise RuntimeError(f"a step has {len(needed)} adapters, over max_loras ({self.config.max_loras})")
        slot_of = {adapter_id: self._acquire(lora, needed) for adapter_id, lora in needed.items()}
        row_slots = np.fromiter(
            (slot_of[lora.lora_int_id] if lora is not None else NO_SLOT for lora in row_loras),
            dtype=np.int32,
            count=len(row_loras),
        )
        self.index.set_batch(row_slots, num_scheduled, num_input_tokens)

    def _acquire(self, lora: LoRARequest, needed: dict[int, LoRARequest]) -> int:
        adapter_id = lora.lora_int_id
        if adapter_id in self._slots:
            self._slots.move_to_end(adapter_id)
            return self._slots[adapter_id]
        if self._free_slots:
            slot = self._free_slots.pop(0)
        else:
            victim = next(a for a in self._slots if a not in needed)
            slot = self._slots.pop(victim)
        adapter = self._adapter(lora)
        for layer in self.layers.values():
            layer.set_slot(slot, adapter)
        self._slots[adapter_id] = slot
        self.num_slot_loads += 1
        return slot

    def _adapter(self, lora: LoRARequest) -> PeftAdapter:
        """The adapter's tensors from the CPU cache, else from its files (then cached)."""
        adapter_id = lora.lora_int_id
        adapter = self._cpu_cache.get(adapter_id)
        if adapter is not None:
            self._cpu_cache.move_to_end(adapter_id)
            return adapter
        adapter = read_adapter(lora, self.hf_config, self.config.max_lora_rank, load_weights=True, dtype=self.dtype)
        self.num_file_loads += 1
        self._cpu_cache[adapter_id] = adapter
        while len(self._cpu_cache) > self.config.cpu_cache_size:
            self._cpu_cache.popitem(last=False)
        return adapter
