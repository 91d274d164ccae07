"""The sampler: one token per row from the logits of the rows that sample this step."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagoda.sample.metadata import SamplingMetadata
from pagoda.sample.ops import gumbel_max, truncation_cutoff

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64, on the logits' device


class Sampler(nn.Module):
    """Greedy and random rows in one batch, with no loop over rows and no generator state.

    Random rows draw by Gumbel-max: argmax(logits / T + g) over the tokens that top-k, top-p
    and min-p keep, with g keyed by (seed, output position, token), so a request's tokens
    are reproducible whatever batch it runs in. The logits are never modified.
    """

    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        super().__init__()
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits: [B, V] (any float dtype; compared in float32), one row per entry of metadata."""
        if metadata.all_greedy:
            return SamplerOutput(logits.argmax(dim=-1))
        cutoff = truncation_cutoff(logits, metadata.temperature, metadata.top_k, metadata.top_p, metadata.min_p)
        sampled = gumbel_max(logits, metadata.temperature, metadata.seeds, metadata.output_positions, cutoff)
        return SamplerOutput(sampled)
