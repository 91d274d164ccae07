"""`CompileCache`: compiled grammars by (spec, tokenizer), shared by every request that asks the same.

Requests of one schema (n > 1 samples, a server's repeated response_format) compile once. The
cache is bounded by entry count, least recently used out first, and safe to use from the
manager's compile threads and the step loop at once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")

DEFAULT_MAX_ENTRIES = 256


class CompileCache(Generic[T]):
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[Hashable, T] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get_or_compile(self, key: Hashable, compile_fn: Callable[[], T]) -> T:
        """The cached value of `key`, else `compile_fn()` stored under it (an exception is not cached).

        Compiling happens outside the lock: two threads missing the same key both compile, and
        the second result replaces the first; the manager avoids that by sharing one future per key.
        """
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                self.hits += 1
                return self._entries[key]
            self.misses += 1
        value = compile_fn()
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._entries)
