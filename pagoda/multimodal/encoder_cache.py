"""`EncoderCache`: encoder outputs (image embeddings) by content hash, on the runner's device.

A request holds the entries of the images it was scheduled to encode until it ends or is
preempted (its later prompt chunks read them). An entry no request holds stays for reuse by a
later request with the same image, up to `capacity` tokens of such entries, oldest dropped first.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: dict[str, torch.Tensor] = {}
        # identifier -> the requests holding it; req_id -> the identifiers it holds.
        self._holders: dict[str, set[str]] = {}
        self._held: dict[str, set[str]] = {}
        # Entries no request holds, oldest first, and their total tokens.
        self._idle: OrderedDict[str, None] = OrderedDict()
        self._idle_tokens = 0
        self.hits = 0
        self.misses = 0

    def acquire(self, identifier: str, req_id: str) -> bool:
        """Hold the entry for `req_id` if it exists (a hit); False: it must be computed and `put`."""
        if identifier not in self._entries:
            self.misses += 1
            return False
        self.hits += 1
        self._hold(identifier, req_id)
        return True

    def put(self, identifier: str, output: torch.Tensor, req_id: str) -> None:
        self._entries[identifier] = output
        self._hold(identifier, req_id)

    def get(self, identifier: str) -> torch.Tensor:
        return self._entries[identifier]

    def release(self, req_id: str) -> None:
        """`req_id` ended or was preempted: its entries become idle once no one else holds them."""
        for identifier in self._held.pop(req_id, ()):
            holders = self._holders[identifier]
            holders.discard(req_id)
            if not holders:
                del self._holders[identifier]
                self._idle[identifier] = None
                self._idle_tokens += len(self._entries[identifier])
        while self._idle_tokens > self.capacity:
            identifier, _ = self._idle.popitem(last=False)
            self._idle_tokens -= len(self._entries.pop(identifier))

    def _hold(self, identifier: str, req_id: str) -> None:
        if identifier in self._idle:
            del self._idle[identifier]
            self._idle_tokens -= len(self._entries[identifier])
        self._holders.setdefault(identifier, set()).add(req_id)
        self._held.setdefault(req_id, set()).add(identifier)

    @property
    def held_req_ids(self) -> list[str]:
        return list(self._held)

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop the idle entries (new weights make them stale); held ones stay for their requests."""
        for identifier in self._idle:
            del self._entries[identifier]
        self._idle.clear()
        self._idle_tokens = 0
