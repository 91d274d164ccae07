"""The per-row sampling settings the model runner hands the sampler each step."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    """Device tensors, one entry per sampled row, mirrored from the persistent input batch.

    The optional filters are None when no row of the step uses them, so the sampler can skip
    their work (the sort above all) without looking at the values.
    """

    temperature: torch.Tensor  # [B] float32; below 1e-5 means a greedy row
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [B] int32; <= 0 or >= vocab size means off
    top_p: torch.Tensor | None  # [B] float32; 1.0 means off
    min_p: torch.Tensor | None  # [B] float32; 0.0 means off
    seeds: torch.Tensor  # [B] int64; the runner draws one for unseeded requests
    output_positions: torch.Tensor  # [B] int64; index in the request's output of the token being sampled
