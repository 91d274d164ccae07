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
from pagoda.model.layers.quantization import gguf_kernels
from pagoda.model.layers.quantization.base import current_vocab_blocks_type, new_parameter
from pagoda.model.layers.quantization.gguf_blocks import blocks_linear
from pagoda.model.layers.weight_utils import CheckpointWeight, copy_weight, narrow_weight


class VocabParallelEmbedding(nn.Module):
    IS_LM_HEAD = False

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_size = get_tp_size()
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = get_tp_rank() * self.num_embeddings_per_rank
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_rank, num_embeddings)
        self.dtype = torch.get_default_dtype()
        # The GGUF blocks' type where this layer keeps them (gguf_weights="blocks": one rank).
        self.blocks_type = current_vocab_blocks_type(self.IS_LM_HEAD)
        if self.blocks_type is None:
            self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_rank, embedding_dim), requires_grad=False)
            self.weight.weight_loader = self.weight_loader
        else:
            assert self.tp_size == 1, "GGUF blocks for the vocabulary need one rank"
            row_bytes = embedding_dim // 32 * gguf_kernels.BLOCK_BYTES[self.blocks_type]
            self.gguf_blocks = new_parameter((num_embeddings, row_bytes), torch.uint8)
            self.gguf_blocks.weight_loader = self.weight_loader

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
        if self.blocks_type is not None:
            kernels = gguf_kernels.load()
            assert kernels is not None, "gguf_weights 'blocks' resolved without the kernels"
            rows = gguf_kernels.dequantize(kernels, self.gguf_blocks[input_ids.reshape(-1)], self.blocks_type)
            return rows.view(*input_ids.shape, -1).to(self.dtype)
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start) * in_range
        out = F.embedding(local_ids, self.weight) * in_range.unsqueeze(-1).to(self.weight.dtype)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden states [N, hidden] -> logits [N, vocab] over the full vocabulary on every rank."""

    IS_LM_HEAD = True
    # GGUF blocks: the kernel at any row count, on a team of threads. The head is one large GEMV
    # a step (SmolLM2's 49,152 x 576 Q8_0 on the 2-core AVX2 machine: 1.6 ms a token on two
    # threads, 3.0 on one, 10.8 in float32 F.linear), and even at 32 rows the kernel (22.8 ms)
    # beat F.linear over a resident float32 weight (30.5) and over one dequantized per step (73).
    BLOCKS_THREADS = 2

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.batch_invariant = batch_invariant_now()
        # The engine's compute threads are set before the model is built.
        self.blocks_threads = min(self.BLOCKS_THREADS, torch.get_num_threads())

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share `embedding`'s weight, or its GGUF blocks (tied word embeddings)."""
        assert self.blocks_type == embedding.blocks_type, "a tied LM head keeps what its embedding keeps"
        if self.blocks_type is None:
            self.weight = embedding.weight
        else:
            self.gguf_blocks = embedding.gguf_blocks

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.blocks_type is not None:
            logits = blocks_linear(
                self.gguf_blocks, hidden_states, self.blocks_type, self.blocks_threads, any_tokens=True
            )
            return logits.to(self.dtype)
        logits = tensor_model_parallel_all_gather(
            ops.linear(hidden_states, self.weight, batch_invariant=self.batch_invariant), dim=-1
        )
        return logits[..., : self.num_embeddings]
