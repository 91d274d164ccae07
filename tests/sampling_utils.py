"""Reference implementations of logits processing, written straight from the definitions
(one token at a time, in float64), for the sampler and engine tests to compare against."""

from __future__ import annotations

from collections import Counter

import torch

from pagoda.sampling_params import SamplingParams


def reference_processed_logits(
    logits_row: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams
) -> torch.Tensor:
    """[V] float64: allowed_token_ids, bad words, min_tokens, logit_bias, repetition, frequency, presence.

    min_tokens hides `stop_token_ids` and the engine-filled `all_stop_token_ids` (eos)."""
    x = logits_row.double().cpu().clone()
    if params.allowed_token_ids is not None:
        keep = torch.zeros_like(x, dtype=torch.bool)
        keep[params.allowed_token_ids] = True
        x[~keep] = float("-inf")
    for word in params.bad_words_token_ids:
        prefix = word[:-1]
        if len(output) >= len(prefix) and output[len(output) - len(prefix) :] == prefix:
            x[word[-1]] = float("-inf")
    if len(output) < params.min_tokens:
        for token in set(params.stop_token_ids) | params.all_stop_token_ids:
            x[token] = float("-inf")
    for token, bias in (params.logit_bias or {}).items():
        x[token] += bias
    for token in set(prompt) | set(output):
        if x[token] < 0:
            x[token] *= params.repetition_penalty
        else:
            x[token] /= params.repetition_penalty
    for token, count in Counter(output).items():
        x[token] -= params.frequency_penalty * count + params.presence_penalty
    return x
