"""Bounds on a request's size that are checked before anything is tokenized, so that an input
that can never fit the context is refused at once instead of costing seconds of tokenizing.

The bounds are exact, not guesses: a token covers at most as many characters as its longest
vocabulary entry, so a text of more than `max_model_len` times that many characters always
tokenizes to more than `max_model_len` tokens. That holds only for tokenizers that cannot
drop characters or fold an unbounded run of them into one token (no stripping normalizer,
no whitespace-removing pre-tokenizer, no fused unknown token); for the others there is no
character bound. Each chat message renders to at least one token (its role marker), so a
conversation of more messages than `max_model_len` cannot fit either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

# Normalizers and pre-tokenizers that never shorten a text (by character count).
_LENGTH_KEEPING_NORMALIZERS = {"Prepend", "NFD", "NFKD", "Lowercase", "ByteLevel"}
_LENGTH_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int
    # Characters of text (a prompt, or a conversation's contents) past which it cannot fit;
    # None where the tokenizer gives no exact bound (or there is no tokenizer).
    max_prompt_chars: int | None
    # The model takes images: chat's image_url parts are accepted (else refused naming the need).
    accepts_images: bool = False

    @property
    def max_messages(self) -> int:
        return self.max_model_len


def request_limits(tokenizer: PreTrainedTokenizerBase | None, max_model_len: int) -> RequestLimits:
    chars = max_chars_per_token(tokenizer) if tokenizer is not None else None
    return RequestLimits(max_model_len, max_model_len * chars if chars is not None else None)


def max_chars_per_token(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The most characters of text one token can stand for (its vocabulary entry's length:
    a byte-level entry has one symbol per byte), or None when the tokenizer may shorten text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    pipeline = json.loads(backend.to_str())
    if not (
        _keeps_length(pipeline.get("normalizer"), _normalizer_keeps_length)
        and _keeps_length(pipeline.get("pre_tokenizer"), _pre_tokenizer_keeps_length)
        and _model_keeps_length(pipeline["model"], byte_level='"ByteLevel"' in json.dumps(pipeline["pre_tokenizer"]))
    ):
        return None
    entries = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max(len(entry) for entry in entries if entry is not None)


def _keeps_length(step: dict[str, Any] | None, keeps: Any) -> bool:
    """A pipeline step (None, one step, or a Sequence of them) never shortens a text."""
    if step is None:
        return True
    if step["type"] == "Sequence":
        parts = step.get("normalizers", step.get("pretokenizers", []))
        return all(_keeps_length(part, keeps) for part in parts)
    return keeps(step)


def _normalizer_keeps_length(step: dict[str, Any]) -> bool:
    if step["type"] == "Replace":
        pattern = step["pattern"].get("String")
        return pattern is not None and len(step["content"]) >= len(pattern)
    return step["type"] in _LENGTH_KEEPING_NORMALIZERS


def _pre_tokenizer_keeps_length(step: dict[str, Any]) -> bool:
    return step["type"] in _LENGTH_KEEPING_PRE_TOKENIZERS and step.get("behavior") != "Removed"


def _model_keeps_length(model: dict[str, Any], byte_level: bool) -> bool:
    """BPE gives every character a token when every byte is in its vocabulary (byte-level or
    byte fallback) or an unknown one becomes an unknown token of its own; otherwise it may
    drop characters or fuse a run of unknown ones into one token."""
    if model["type"] != "BPE":
        return False
    return (
        byte_level
        or model.get("byte_fallback", False)
        or (model.get("unk_token") is not None and not model.get("fuse_unk"))
    )
