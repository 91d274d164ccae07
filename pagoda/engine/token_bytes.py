"""Each token's raw UTF-8 bytes, and where tokens start in the text they decode to.

Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) and byte-fallback sentencepiece split an emoji
or a CJK character over several tokens; each of those decodes alone to U+FFFD, so its decoded
text can neither be joined back into the character nor be counted for offsets. Its bytes can:
OpenAI's `bytes` field carries them, and `text_offset` counts characters on them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from transformers import PreTrainedTokenizerBase

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SENTENCEPIECE_SPACE = "\u2581"


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted (as byte-level BPE stores tokens)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


def _decoder_parts(tokenizer: PreTrainedTokenizerBase) -> list[dict]:
    """The fast tokenizer's decoder as a list of steps (a Sequence's parts); empty for a slow one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return []
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return [part for part in parts if part]


def _stripped_leading_spaces(parts: list[dict]) -> int:
    """Spaces a `Strip` step drops from the start of decoded text (sentencepiece's word-start mark)."""
    return sum(part.get("start", 0) for part in parts if part.get("type") == "Strip" and part.get("content") == " ")


class TokenBytes:
    """The bytes of every token id of a tokenizer, computed once (a pass over the vocabulary)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        parts = _decoder_parts(tokenizer)
        types = {part.get("type") for part in parts}
        # Leading spaces decoding drops at the start of a text (see TextOffsets).
        self.stripped_leading_spaces = _stripped_leading_spaces(parts)
        byte_decoder = _gpt2_byte_decoder() if "ByteLevel" in types else None
        special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
        self.special_ids = frozenset(special)
        self._table: list[bytes] = []
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        for token_id, piece in enumerate(pieces):
            if piece is None:
                self._table.append(b"")
            elif token_id in special:
                self._table.append(piece.encode())
            elif byte_decoder is not None and all(char in byte_decoder for char in piece):
                self._table.append(bytes(byte_decoder[char] for char in piece))
            elif (match := _BYTE_FALLBACK.fullmatch(piece)) is not None:
                self._table.append(bytes([int(match.group(1), 16)]))
            elif "Metaspace" in types or "Replace" in types:
                self._table.append(piece.replace(SENTENCEPIECE_SPACE, " ").encode())
            else:
                self._table.append(tokenizer.decode([token_id]).encode())

    def __call__(self, token_id: int) -> bytes:
        """The token's own bytes (a special token's are its text); b"" for an id past the vocabulary."""
        return self._table[token_id] if 0 <= token_id < len(self._table) else b""

    def in_text(self, token_id: int, skip_special_tokens: bool) -> bytes:
        """The bytes the token adds to decoded text: none for a special token the text skips."""
        if skip_special_tokens and token_id in self.special_ids:
            return b""
        return self(token_id)


def _is_continuation(byte: int) -> bool:
    return byte & 0xC0 == 0x80


class TextOffsets:
    """Where each token starts in its text, in characters, counted across calls (a stream).

    Character k of UTF-8 text starts at its k-th lead (non-continuation) byte, so a token starts
    at the number of lead bytes before it, or at the character it completes when its first byte
    continues one begun earlier. The first `stripped_leading_spaces` spaces of the text are not
    counted (decoders of sentencepiece models drop them). Offsets never go backwards and never
    pass `limit` (the text's length, where decoded text differs from the bytes otherwise).
    """

    def __init__(self, start: int = 0, stripped_leading_spaces: int = 0) -> None:
        self._leads = start
        self._last = start
        self._to_strip = stripped_leading_spaces

    def advance(self, token_bytes: Iterable[bytes], limit: int | None = None) -> list[int]:
        offsets = []
        for data in token_bytes:
            offset = self._leads
            if data and _is_continuation(data[0]) and self._leads > 0:
                offset -= 1
            offset = max(offset, self._last)
            if limit is not None:
                offset = min(offset, limit)
            offsets.append(offset)
            self._last = offset
            self._count(data)
        return offsets

    def _count(self, data: bytes) -> None:
        for byte in data:
            if self._to_strip and byte == 0x20:
                self._to_strip -= 1
                continue
            self._to_strip = 0
            if not _is_continuation(byte):
                self._leads += 1
