"""Incremental detokenization and stop-string matching.

`tokenizers.decoders.DecodeStream` turns one token id at a time into text, holding back
partial UTF-8 sequences, so the cost per token is constant however long the output grows.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> None:
        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is None:
            raise TypeError(f"incremental detokenization needs a fast tokenizer, got {type(tokenizer).__name__}")
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def push(self, token_ids: list[int]) -> str:
        """Decode newly generated tokens; returns the text they complete."""
        if len(token_ids) == 1:  # a decode step's one token
            return self._stream.step(self._backend, token_ids[0]) or ""
        pieces = (self._stream.step(self._backend, token_id) for token_id in token_ids)
        return "".join(piece for piece in pieces if piece)


def find_stop_string(text: str, num_new_chars: int, stops: list[str], include_stop: bool) -> tuple[str, int] | None:
    """The earliest stop string that ends inside the last `num_new_chars` characters.

    Returns (stop string, length to truncate the text to), or None.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index >= 0 and (best is None or index < best[0]):
            best = (index, stop)
    if best is None:
        return None
    index, stop = best
    return stop, index + len(stop) if include_stop else index
