"""The compile cache: one compile per key, least recently used entries out first, errors not cached."""

from __future__ import annotations

import pytest

from pagoda.structured_output.cache import CompileCache


def test_hits_evictions_and_errors() -> None:
    cache: CompileCache[str] = CompileCache(max_entries=2)
    calls: list[str] = []

    def compile_fn(key: str):
        return lambda: calls.append(key) or key.upper()

    assert cache.get_or_compile("a", compile_fn("a")) == "A"
    assert cache.get_or_compile("a", compile_fn("a")) == "A"
    cache.get_or_compile("b", compile_fn("b"))
    cache.get_or_compile("a", compile_fn("a"))  # a is now the most recent
    cache.get_or_compile("c", compile_fn("c"))  # evicts b
    assert len(cache) == 2 and calls == ["a", "b", "c"]
    cache.get_or_compile("b", compile_fn("b"))
    assert calls == ["a", "b", "c", "b"]

    def failing():
        raise ValueError("bad")

    with pytest.raises(ValueError):
        cache.get_or_compile("x", failing)
    assert cache.get_or_compile("x", compile_fn("x")) == "X"
