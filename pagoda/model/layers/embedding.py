"""Token embedding and LM head, with the vocabulary split across tensor-parallel ranks.

Each rank holds `ceil(vocab / tp)` rows (the last rank's tail is zero padding). The embedding
looks up the ids in its range and all-reduces; the LM head computes logits for its rows and
all-gathers them. The two can share one weight (tied embeddings) since they split alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.distributed.parallel_state import (
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from pagoda.model import ops
from pagoda.model.layers.batch_invariance import batch_invariant_now
from pagoda.model.layers.weight_utils import CheckpointWeight, copy_weight, narrow_weight


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_size = get_tp_size()
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = get_tp_rank() * self.num_embeddings_per_rank
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_rank, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: CheckpointWeight, shard_id: None = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shards, got shard_id {shard_id!r}")
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(
                f"checkpoint has {loaded_weight.shape[0]} vocabulary rows, the config {self.num_embeddings}"
            )
        num_rows = self.vocab_end - self.vocab_start
        copy_weight(param.data[:num_rows], narrow_weight(loaded_weight, 0, self.vocab_start, num_rows))
        param.data[num_rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start) * in_range
        out = F.embedding(local_ids, self.weight) * in_range.unsqueeze(-1).to(self.weight.dtype)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden states [N, hidden] -> logits [N, vocab] over the full vocabulary on every rank."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.batch_invariant = batch_invariant_now()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = tensor_model_parallel_all_gather(
            ops.linear(hidden_states, self.weight, batch_invariant=self.batch_invariant), dim=-1
        )
        return logits[..., : self.num_embeddings]
