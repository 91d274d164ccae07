"""The sampler: one token per row from the logits of the rows that sample this step."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagoda.config import LOGPROBS_MODES
from pagoda.sample.logits_processing import process_logits
from pagoda.sample.logprobs import LogprobsTensors, top_logprobs
from pagoda.sample.metadata import SamplingMetadata
from pagoda.sample.ops import gumbel_max, inverse_temperature, truncation_cutoff


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64, on the logits' device
    logprobs: LogprobsTensors | None = None  # [B, 1 + max_num_logprobs], when a row asked


class Sampler(nn.Module):
    """Greedy and random rows in one batch, with no loop over rows and no generator state.

    Logits are first processed (see `process_logits`), on a copy and only for the passes the
    step needs. Random rows then draw by Gumbel-max: argmax(logits / T + g) over the tokens
    that top-k, top-p and min-p keep, with g keyed by (seed, output position, token), so a
    request's tokens are reproducible whatever batch it runs in. Greedy rows take the argmax
    of the processed logits.
    """

    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        super().__init__()
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits: [B, V] (any float dtype; compared in float32), one row per entry of metadata."""
        processed = process_logits(logits, metadata)
        wants_logprobs = metadata.max_num_logprobs is not None
        processed_logprobs = wants_logprobs and self.logprobs_mode.startswith("processed")
        cutoff = None
        if not metadata.all_greedy or processed_logprobs:
            cutoff = truncation_cutoff(processed, metadata.temperature, metadata.top_k, metadata.top_p, metadata.min_p)
        if metadata.all_greedy:
            sampled = processed.argmax(dim=-1)
        else:
            sampled = gumbel_max(processed, metadata.temperature, metadata.seeds, metadata.output_positions, cutoff)
        if not wants_logprobs:
            return SamplerOutput(sampled)
        if processed_logprobs:
            values = processed.float() * inverse_temperature(metadata.temperature)[:, None]
            if cutoff is not None:
                values.masked_fill_(values < cutoff[:, None], float("-inf"))
        else:
            values = logits
        normalize = self.logprobs_mode.endswith("logprobs")
        return SamplerOutput(sampled, top_logprobs(values, sampled, metadata.max_num_logprobs, normalize))
