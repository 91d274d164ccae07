"""Verification of draft tokens against the model's own samples, on the device.

The sampler draws each position's token as a pure function of (seed, output position) and the
logits (Gumbel-max; argmax for greedy rows), so a request's token at a position is fixed by its
prefix. A verify step samples at every position of a row (after its last known token and after
each draft): draft j is accepted while every draft before it was and it equals the model's
sample at its position; the row then emits its accepted drafts and the model's sample after the
last of them. The tokens are exactly those the request would produce one step at a time
(wherever the verify forward's logits equal one-token decodes': always in float32 on the CPU).
For a deterministic proposer this accepts draft d with probability p(d) and, after a rejection,
emits a token distributed as rejection sampling's residual, so no rejection sampler is needed.

`forced_acceptance` (benchmarks only) accepts each draft with probability alpha whatever the
model says, to time the machinery at a known acceptance rate on dummy weights.
"""

from __future__ import annotations

import torch


def verify_drafts(
    sampled: torch.Tensor,
    logits_start: torch.Tensor,
    drafts: torch.Tensor,
    forced_acceptance: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """[R, K + 1] int64: each row's emitted tokens, -1 past its last.

    sampled: [T] the model's sample at every logits position; row r's positions are
    `logits_start[r]` .. + its number of drafts; drafts: [R, K] int64, -1 past a row's last.
    """
    num_rows, num_drafts = drafts.shape
    columns = torch.arange(num_drafts + 1, device=sampled.device)
    has_position = torch.nn.functional.pad(drafts >= 0, (1, 0), value=True)
    index = (logits_start[:, None] + columns).clamp_(max=sampled.shape[0] - 1)
    samples = torch.where(has_position, sampled[index], -1)
    if forced_acceptance is None:
        agrees = samples[:, :-1] == drafts
    else:
        draws = torch.rand((num_rows, num_drafts), device=sampled.device, generator=generator)
        agrees = draws < forced_acceptance
    agrees &= drafts >= 0
    num_accepted = agrees.to(torch.int64).cumprod(dim=1).sum(dim=1, keepdim=True)
    # Accepted drafts (equal to the model's samples unless forced), then the model's sample.
    emitted = torch.where(columns[:-1] < num_accepted, drafts, samples[:, :-1])
    emitted = torch.cat([emitted, samples[:, -1:]], dim=1)
    return torch.where(columns <= num_accepted, emitted, -1)
