"""Text a stream must hold back: the end of what arrived so far that may be the start of a
marker (a stop string, a `<tool_call>` tag), decided only by the text still to come."""

from __future__ import annotations


def pending_stop_prefix(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that is the start of a stop string (and not all of
    it): text that a stop string may still swallow."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest
