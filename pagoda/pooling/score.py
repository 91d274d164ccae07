"""Scores of text pairs for bi-encoders: the cosine similarity of their embeddings."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagoda.errors import InvalidRequestError


def cosine_similarity(a: np.ndarray, b: np.ndarray) -> float:
    """In float64; 0 for a zero vector (it points nowhere)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b) / norms if norms else 0.0


def score_pairs(first: str | Sequence, second: str | Sequence, names: tuple[str, str]) -> list[tuple[object, object]]:
    """vLLM's pairing: one first item against each second item, or two lists of equal length pairwise.
    An item is a text or a list of token ids; `names` are the two fields, for errors."""
    first_items, second_items = _items(first), _items(second)
    if not first_items or not second_items:
        raise InvalidRequestError(names[0] if not first_items else names[1], "there must be something to score")
    if len(first_items) == 1:
        first_items = first_items * len(second_items)
    if len(first_items) != len(second_items):
        raise InvalidRequestError(
            names[1],
            f"{names[0]} has {len(first_items)} items and {names[1]} has {len(second_items)}: "
            f"give one {names[0]} item, or as many as {names[1]} has",
        )
    return list(zip(first_items, second_items, strict=True))


def _items(value: str | Sequence) -> list:
    if isinstance(value, str):
        return [value]
    items = list(value)
    if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [items]  # one prompt given as token ids
    return items
