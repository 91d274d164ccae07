"""Prompt logprobs from the hidden states of a prefill chunk.

Prompt token t (t >= 1) is predicted by the hidden state at position t - 1, so a chunk
computing positions [start, start + n) scores the prompt tokens start + 1 .. start + n, up
to the prompt's last token. Logits are computed only for those positions of the requests
that asked, a slice at a time, so the [positions, vocab] temporary stays bounded however
long the chunk.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagoda.outputs import LogprobsArrays
from pagoda.sample.logprobs import top_logprobs

# Positions per logits computation: bounds the float32 [positions, vocab] temporary.
POSITIONS_PER_SLICE = 512


def empty_prompt_logprobs(num_prompt_tokens: int, num_top: int) -> LogprobsArrays:
    """A buffer with one row per prompt token after the first, filled as chunks are computed."""
    shape = (max(num_prompt_tokens - 1, 0), 1 + num_top)
    return LogprobsArrays(np.zeros(shape, np.int64), np.zeros(shape, np.float32), np.zeros(shape, np.int64))


def scored_positions(
    chunk_starts: np.ndarray, query_starts: np.ndarray, query_lens: np.ndarray, num_prompt_tokens: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per request: how many prompt tokens this chunk scores; and flat over them, the hidden-state
    index (in the step's tokens) and the scored token's position in the prompt."""
    ends = np.minimum(chunk_starts + query_lens, num_prompt_tokens - 1)
    counts = np.maximum(ends - chunk_starts, 0).astype(np.int64)
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    hidden_index = np.repeat(query_starts, counts) + offsets
    positions = np.repeat(chunk_starts + 1, counts) + offsets
    return counts, hidden_index, positions


def compute_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden_states: torch.Tensor,
    hidden_index: np.ndarray,
    token_ids: np.ndarray,
    num_top: int,
    normalize: bool,
) -> LogprobsArrays:
    """Logprobs (or logits, normalize=False) of `token_ids`, each scored at its hidden state, with the top `num_top`."""
    device = hidden_states.device
    index = torch.from_numpy(hidden_index).to(device)
    targets = torch.from_numpy(token_ids.astype(np.int64)).to(device)
    parts = []
    for start in range(0, len(hidden_index), POSITIONS_PER_SLICE):
        rows = slice(start, start + POSITIONS_PER_SLICE)
        logits = compute_logits(hidden_states[index[rows]])
        parts.append(top_logprobs(logits, targets[rows], num_top, normalize).to_arrays())
    return LogprobsArrays(
        np.concatenate([p.token_ids for p in parts]),
        np.concatenate([p.logprobs for p in parts]),
        np.concatenate([p.ranks for p in parts]),
    )
