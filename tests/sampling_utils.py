"""Reference implementations of logits processing, written straight from the definitions
(one token at a time, in float64), for the sampler and engine tests to compare against; the
sampling metadata the runner would build, and the chi-square bound the frequency tests use."""

from __future__ import annotations

import math
from collections import Counter

import torch

from pagoda.sample.metadata import SamplingMetadata
from pagoda.sampling_params import SamplingParams


def reference_processed_logits(
    logits_row: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams
) -> torch.Tensor:
    """[V] float64: logit_bias, repetition, frequency, presence, then min_tokens, bad words and
    allowed_token_ids (the masks, the allowed set last).

    min_tokens hides `stop_token_ids` and the engine-filled `all_stop_token_ids` (eos)."""
    x = logits_row.double().cpu().clone()
    for token, bias in (params.logit_bias or {}).items():
        x[token] += bias
    for token in set(prompt) | set(output):
        if x[token] < 0:
            x[token] *= params.repetition_penalty
        else:
            x[token] /= params.repetition_penalty
    for token, count in Counter(output).items():
        x[token] -= params.frequency_penalty * count + params.presence_penalty
    if len(output) < params.min_tokens:
        for token in set(params.stop_token_ids) | params.all_stop_token_ids:
            x[token] = float("-inf")
    for word in params.bad_words_token_ids:
        prefix = word[:-1]
        if len(output) >= len(prefix) and output[len(output) - len(prefix) :] == prefix:
            x[word[-1]] = float("-inf")
    if params.allowed_token_ids is not None:
        keep = torch.zeros_like(x, dtype=torch.bool)
        keep[params.allowed_token_ids] = True
        x[~keep] = float("-inf")
    return x


def make_metadata(
    temperature: list[float],
    seeds: list[int],
    output_positions: list[int],
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
    min_p: list[float] | None = None,
    device: str = "cpu",
) -> SamplingMetadata:
    """What the runner builds from its per-row arrays."""
    greedy = [t < 1e-5 for t in temperature]

    def optional(values: list | None, dtype: torch.dtype) -> torch.Tensor | None:
        return None if values is None else torch.tensor(values, dtype=dtype, device=device)

    return SamplingMetadata(
        temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_k=optional(top_k, torch.int32),
        top_p=optional(top_p, torch.float32),
        min_p=optional(min_p, torch.float32),
        seeds=torch.tensor(seeds, dtype=torch.int64, device=device),
        output_positions=torch.tensor(output_positions, dtype=torch.int64, device=device),
    )


def chi_square_critical_value(degrees_of_freedom: int, z: float = 3.0902) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty; z is the normal's 0.999 quantile)."""
    k = degrees_of_freedom
    return k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3
