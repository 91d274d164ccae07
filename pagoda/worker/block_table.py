"""`BlockTable`: each batch row's physical KV block ids, in a NumPy array with a device mirror;
`MultiGroupBlockTable`: one of them per KV-cache group.

The device copy is refreshed only for rows that changed since the last step, so a decode step
that allocates no new block sends nothing.
"""

from __future__ import annotations

import numpy as np
import torch


class BlockTable:
    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, device: torch.device, pin_memory: bool) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.block_table_cpu = torch.zeros(
            (max_num_reqs, max_num_blocks_per_req), dtype=torch.int32, pin_memory=pin_memory
        )
        self.block_table_np = self.block_table_cpu.numpy()
        self.block_table = torch.zeros((max_num_reqs, max_num_blocks_per_req), dtype=torch.int32, device=device)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)
        self._dirty_rows: set[int] = set()
        # Bumped whenever a row's existing block ids may change (rows added, cleared, moved,
        # swapped), not when blocks are appended after them: what a plan over the rows'
        # leading blocks (the cascade's) is reused against.
        self.layout_version = 0

    def append_row(self, block_ids: list[int], row: int) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks_per_row[row])
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(
                f"row {row} needs {end} blocks, more than max_num_blocks_per_req ({self.max_num_blocks_per_req})"
            )
        self.block_table_np[row, start:end] = block_ids
        self.num_blocks_per_row[row] = end
        self._dirty_rows.add(row)

    def add_row(self, block_ids: list[int], row: int) -> None:
        self.layout_version += 1
        self.num_blocks_per_row[row] = 0
        self.append_row(block_ids, row)

    def clear_row(self, row: int) -> None:
        self.layout_version += 1
        self.num_blocks_per_row[row] = 0

    def move_row(self, src: int, dst: int) -> None:
        self.layout_version += 1
        num_blocks = int(self.num_blocks_per_row[src])
        self.block_table_np[dst, :num_blocks] = self.block_table_np[src, :num_blocks]
        self.num_blocks_per_row[dst] = num_blocks
        self.num_blocks_per_row[src] = 0
        self._dirty_rows.add(dst)

    def swap_row(self, a: int, b: int) -> None:
        self.layout_version += 1
        self.num_blocks_per_row[[a, b]] = self.num_blocks_per_row[[b, a]]
        self.block_table_np[[a, b]] = self.block_table_np[[b, a]]
        self._dirty_rows.update((a, b))

    def row(self, row: int) -> list[int]:
        return self.block_table_np[row, : self.num_blocks_per_row[row]].tolist()

    def device_slots(self, rows: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
        """int64 KV slots of `positions` in batch rows `rows` (device tensors, broadcast against
        each other), read from the device table (committed): for positions only the device
        knows. A position past the table's last column reads that column: callers mask it."""
        columns = (positions // block_size).clamp_(max=self.max_num_blocks_per_req - 1)
        return self.block_table[rows, columns].to(torch.int64) * block_size + positions % block_size

    def commit(self, num_reqs: int) -> torch.Tensor:
        """Send the changed rows to the device; returns the [num_reqs, max_blocks] device view."""
        rows = [r for r in self._dirty_rows if r < num_reqs]
        self._dirty_rows.clear()
        if rows:
            # One copy of the span covering every changed row: rows in between already match.
            lo, hi = min(rows), max(rows) + 1
            self.block_table[lo:hi].copy_(self.block_table_cpu[lo:hi], non_blocking=True)
        return self.block_table[:num_reqs]


class MultiGroupBlockTable:
    """One `BlockTable` per KV-cache group (each with its own block size), moved together."""

    def __init__(
        self, max_num_reqs: int, max_model_len: int, block_sizes: list[int], device: torch.device, pin_memory: bool
    ) -> None:
        self.block_sizes = list(block_sizes)
        self.tables = [
            BlockTable(max_num_reqs, -(max_model_len // -block_size), device, pin_memory) for block_size in block_sizes
        ]

    def __getitem__(self, group: int) -> BlockTable:
        return self.tables[group]

    def __len__(self) -> int:
        return len(self.tables)

    def append_row(self, block_ids: tuple[list[int], ...], row: int) -> None:
        for table, ids in zip(self.tables, block_ids, strict=True):
            table.append_row(ids, row)

    def add_row(self, block_ids: tuple[list[int], ...], row: int) -> None:
        for table, ids in zip(self.tables, block_ids, strict=True):
            table.add_row(ids, row)

    def clear_row(self, row: int) -> None:
        for table in self.tables:
            table.clear_row(row)

    def move_row(self, src: int, dst: int) -> None:
        for table in self.tables:
            table.move_row(src, dst)

    def swap_row(self, a: int, b: int) -> None:
        for table in self.tables:
            table.swap_row(a, b)

    def row(self, row: int) -> tuple[list[int], ...]:
        return tuple(table.row(row) for table in self.tables)
