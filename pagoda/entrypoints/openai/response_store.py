"""Stored responses, for `previous_response_id` and `GET /v1/responses/{id}`: in memory, least
recently used first out, bounded both in count and in the characters of text they keep alive,
so that a server taking responses forever holds a fixed amount. Lost on restart."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagoda.entrypoints.openai.protocol_responses import ResponseObject, Turn

DEFAULT_MAX_RESPONSES = 1000
DEFAULT_MAX_CHARS = 64 * 1024 * 1024


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    # The conversation through this response's answer (instructions are not carried over).
    conversation: tuple[Turn, ...]

    @property
    def num_chars(self) -> int:
        """The text this entry keeps alive (an upper bound: turns are shared along a chain)."""
        return sum(turn.num_chars for turn in self.conversation) + len(self.response.instructions or "")


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        self.max_responses = max_responses
        self.max_chars = max_chars
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._num_chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        """Keep `entry`, evicting the least recently used until both bounds hold (an entry
        larger than `max_chars` on its own is not kept)."""
        self.delete(entry.response.id)
        self._entries[entry.response.id] = entry
        self._num_chars += entry.num_chars
        while self._entries and (len(self._entries) > self.max_responses or self._num_chars > self.max_chars):
            _, evicted = self._entries.popitem(last=False)
            self._num_chars -= evicted.num_chars

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._num_chars -= entry.num_chars
        return True
