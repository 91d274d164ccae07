"""`HostBlockIndex`: which host slot holds which block, with an LRU over the readable ones.

A slot is free, being written (a save in flight: not readable yet, so no load can race it),
or holding a block under its key. Loads pin the slots they read; eviction takes the least
recently used unpinned slot. Plain Python, no tensors: the scheduler owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class HostBlockIndex:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the host KV pool needs at least one block, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        # key -> slot of readable blocks, least recently used first.
        self._cached: OrderedDict[bytes, int] = OrderedDict()
        # key -> slot of blocks being written.
        self._storing: dict[bytes, int] = {}
        self._pins: dict[int, int] = {}
        self.num_evictions = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._cached

    def is_stored_or_storing(self, key: bytes) -> bool:
        return key in self._cached or key in self._storing

    def num_hits(self, keys: Iterable[bytes]) -> int:
        """How many of `keys`, in order, are readable before the first that is not (no side effects)."""
        count = 0
        for key in keys:
            if key not in self._cached:
                break
            count += 1
        return count

    def pin(self, keys: Sequence[bytes]) -> list[int]:
        """The slots of readable `keys`, pinned against eviction until `unpin`, and made most recent."""
        slots = []
        for key in keys:
            slot = self._cached[key]
            self._cached.move_to_end(key)
            self._pins[slot] = self._pins.get(slot, 0) + 1
            slots.append(slot)
        return slots

    def unpin(self, slots: Iterable[int]) -> None:
        for slot in slots:
            count = self._pins[slot] - 1
            if count:
                self._pins[slot] = count
            else:
                del self._pins[slot]

    def reserve(self, key: bytes) -> int | None:
        """A slot to write `key` into (free, else the least recently used unpinned block's);
        None when every slot is pinned or being written."""
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((k for k, s in self._cached.items() if s not in self._pins), None)
            if victim is None:
                return None
            slot = self._cached.pop(victim)
            self.num_evictions += 1
        self._storing[key] = slot
        return slot

    def commit(self, keys: Sequence[bytes]) -> None:
        """Saves of `keys` completed: their blocks become readable, most recent first in line."""
        for key in keys:
            self._cached[key] = self._storing.pop(key)

    def discard(self, keys: Iterable[bytes]) -> None:
        """Forget `keys` (a save or load of them failed), freeing their unpinned slots."""
        for key in keys:
            slot = self._storing.pop(key, None)
            if slot is None and key in self._cached and self._cached[key] not in self._pins:
                slot = self._cached.pop(key)
            if slot is not None:
                self._free.append(slot)

    def reset(self) -> None:
        """Forget every readable unpinned block (their KV was computed with other weights)."""
        for key in [k for k, s in self._cached.items() if s not in self._pins]:
            self._free.append(self._cached.pop(key))

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def check_idle(self) -> None:
        """Raise AssertionError unless nothing is pinned or being written and every slot is
        free or holds exactly one key."""
        problems = []
        if self._pins:
            problems.append(f"host slots {sorted(self._pins)[:16]} still pinned by loads")
        if self._storing:
            problems.append(f"{len(self._storing)} host blocks still being written")
        slots = self._free + list(self._cached.values()) + list(self._storing.values())
        if sorted(slots) != list(range(self.num_slots)):
            problems.append(f"{len(slots)} slots accounted for ({len(set(slots))} distinct), expected {self.num_slots}")
        if problems:
            raise AssertionError("host KV pool not idle: " + "; ".join(problems))
