"""Top-N logprobs of chosen tokens: only the N asked for leave the device, never a vocabulary row."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.outputs import LogprobsArrays


@dataclass
class LogprobsTensors:
    """Device twin of `LogprobsArrays`: column 0 the chosen token, then the top N in rank order."""

    token_ids: torch.Tensor  # [P, 1 + N] int64
    logprobs: torch.Tensor  # [P, 1 + N] float32
    ranks: torch.Tensor  # [P, 1 + N] int64

    def to_arrays(self) -> LogprobsArrays:
        return LogprobsArrays(self.token_ids.cpu().numpy(), self.logprobs.cpu().numpy(), self.ranks.cpu().numpy())


def top_logprobs(values: torch.Tensor, chosen: torch.Tensor, num_top: int, normalize: bool) -> LogprobsTensors:
    """Per row of `values` [P, V]: the chosen token's value and rank, and the `num_top` largest.

    normalize=True turns logits into log probabilities (log_softmax of the row); the ranks
    (1 + the number of strictly larger values) are the same either way. log_softmax, not
    value - logsumexp: CUDA's softmax kernels give each row one block sized by the vocabulary
    alone, where a logsumexp reduction splits rows across blocks by how many rows there are, so
    a row's logprobs would depend on the batch.
    """
    values = values.float()
    chosen = chosen.to(torch.int64)[:, None]
    chosen_values = values.gather(1, chosen)
    chosen_ranks = (values > chosen_values).sum(dim=-1, keepdim=True) + 1
    top_values, top_ids = values.topk(num_top, dim=-1)
    out_ids = torch.cat([chosen, top_ids], dim=1)
    out_values = (
        torch.log_softmax(values, dim=-1).gather(1, out_ids)
        if normalize
        else torch.cat([chosen_values, top_values], dim=1)
    )
    top_ranks = torch.arange(1, num_top + 1, device=values.device).expand(len(values), -1)
    return LogprobsTensors(
        token_ids=out_ids,
        logprobs=out_values,
        ranks=torch.cat([chosen_ranks, top_ranks], dim=1),
    )
