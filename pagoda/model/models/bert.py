"""BERT (`BertModel`): an encoder-only embedding model, as Hugging Face names its weights.

Post-norm blocks of bidirectional self-attention and a GELU MLP over absolute position and
token-type embeddings. Attention runs inside this module with plain torch
(`scaled_dot_product_attention` over each request's own tokens, segmented by the step's
query start offsets) and writes no KV cache: its layers declare `EncoderOnlyAttentionSpec`,
which holds no blocks, so every prompt runs whole in one step (see pagoda/pooling). One rank
only: the linears are not split for tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagoda.attention.backends import AttentionBackend
from pagoda.attention.layer import Attention
from pagoda.forward_context import ForwardContext
from pagoda.kv_cache_interface import EncoderOnlyAttentionSpec
from pagoda.model.layers.weight_utils import default_weight_loader
from pagoda.outputs import IntermediateTensors

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
# Checkpoint tensors BertModel does not use: the pooler (dense + tanh over [CLS], for
# classification heads), pretraining heads, and a saved position-id buffer.
_UNUSED_PREFIXES = ("pooler.", "cls.", "embeddings.position_ids")


class EncoderOnlyAttention(Attention):
    """Every token of a request attends every token of the same request; nothing is cached."""

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> EncoderOnlyAttentionSpec:
        return EncoderOnlyAttentionSpec(block_size, self.num_kv_heads, self.head_size, dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        """q, k, v [T, H*D] -> [T, H*D]; requests of equal length share one batched call."""
        metadata = context.attn_metadata[self.layer_name]
        starts = metadata.query_start_loc_cpu.numpy().astype(np.int64)
        lengths = np.diff(starts)
        num_tokens = q.shape[0]
        shape = (num_tokens, self.num_heads, self.head_size)
        q, k, v = q.view(shape), k.view(shape), v.view(shape)
        out = torch.empty_like(q)
        for length in np.unique(lengths[lengths > 0]).tolist():
            rows = np.flatnonzero(lengths == length)
            index = torch.from_numpy(starts[rows][:, None] + np.arange(length)).to(q.device)
            # [requests, length, heads, head_size] -> [requests, heads, length, head_size]
            query, key, value = (x[index].transpose(1, 2) for x in (q, k, v))
            attended = F.scaled_dot_product_attention(query, key, value, scale=self.impl.scale)
            out[index] = attended.transpose(1, 2)
        return out.view(num_tokens, self.num_heads * self.head_size)


class BertEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One text per request: every token is of token type 0."""
        embeddings = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(embeddings + self.token_type_embeddings.weight[0])


class BertSelfAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend], prefix: str) -> None:
        super().__init__()
        heads = config.num_attention_heads
        head_size = config.hidden_size // heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.attn = EncoderOnlyAttention(heads, head_size, heads, head_size**-0.5, attn_backend, f"{prefix}.attn")

    def forward(self, hidden_states: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        return self.attn(self.query(hidden_states), self.key(hidden_states), self.value(hidden_states), context)


class BertOutput(nn.Module):
    """dense, then LayerNorm over (its output + the block's input): the post-norm residual."""

    def __init__(self, input_size: int, config: PretrainedConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(input_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden_states) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend], prefix: str) -> None:
        super().__init__()
        self.self = BertSelfAttention(config, attn_backend, f"{prefix}.self")
        self.output = BertOutput(config.hidden_size, config)

    def forward(self, hidden_states: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        return self.output(self.self(hidden_states, context), hidden_states)


class BertIntermediate(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(hidden_states))


class BertLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend], prefix: str) -> None:
        super().__init__()
        self.attention = BertAttention(config, attn_backend, f"{prefix}.attention")
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config.intermediate_size, config)

    def forward(self, hidden_states: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        attended = self.attention(hidden_states, context)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        self.layer = nn.ModuleList(
            BertLayer(config, attn_backend, f"encoder.layer.{i}") for i in range(config.num_hidden_layers)
        )


class BertModel(nn.Module):
    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        position_type = getattr(config, "position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ValueError(f"position_embedding_type {position_type!r} is not supported; only 'absolute'")
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config, attn_backend)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        context: ForwardContext,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] int64 (each request's tokens from position 0) -> hidden states [T, hidden]."""
        hidden_states = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            hidden_states = layer(hidden_states, context)
        return hidden_states

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """(HF name, tensor) pairs of a BertModel checkpoint, or of a model with a BERT inside
        ("bert." prefix); the pooler and heads are skipped. Returns the names loaded (unprefixed)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("bert.")
            if name.startswith(_UNUSED_PREFIXES) or hf_name.startswith("cls."):
                continue
            if name not in params:
                raise ValueError(f"checkpoint weight {hf_name!r} has no parameter in {type(self).__name__}")
            try:
                default_weight_loader(params[name], tensor)
            except ValueError as e:
                raise ValueError(f"checkpoint weight {hf_name!r}: {e}") from e
            loaded.add(name)
        return loaded

    def expected_weight_names(self) -> set[str]:
        return {name for name, _ in self.named_parameters()}
