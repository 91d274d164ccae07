"""A causal LM served as an embedding model (Qwen3-Embedding: Qwen3 + last-token pooling).

The same layer stack without the LM head: the runner pools its final hidden states. Embedding
checkpoints are often saved from the bare model (`Qwen3Model`: names without the "model."
prefix, no `lm_head`); both that layout and the causal LM's load.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from transformers import PretrainedConfig

from pagoda.attention.backends import AttentionBackend
from pagoda.model.models.decoder import DecoderForCausalLM, PPMissingLayer


@functools.cache
def as_embedding_model(model_class: type[DecoderForCausalLM]) -> type[DecoderForCausalLM]:
    """`model_class` with its LM head dropped and bare-model weight names accepted."""

    class EmbeddingModel(model_class):
        def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
            super().__init__(config, attn_backend)
            self.lm_head = PPMissingLayer()
            self._other_stage_prefixes = (*self._other_stage_prefixes, "lm_head.")

        def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("an embedding model computes no logits: its hidden states are pooled")

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            return super().load_weights((_causal_lm_name(name), tensor) for name, tensor in weights)

    EmbeddingModel.__name__ = EmbeddingModel.__qualname__ = f"{model_class.__name__}AsEmbedding"
    return EmbeddingModel


def _causal_lm_name(name: str) -> str:
    """A bare model's weight name ("layers.0...") under the causal LM's ("model.layers.0...")."""
    return name if name.startswith(("model.", "lm_head.")) else f"model.{name}"
