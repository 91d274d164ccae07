"""Mamba-2 (`Mamba2ForCausalLM`): an attention-free stack of pre-norm Mamba-2 mixers.

Every layer is a `MambaMixer2` whose recurrent state is one block per request of a `MambaSpec`
KV-cache group; positions are unused (the state carries the order). Weight names are HF's
(backbone.embeddings, backbone.layers.i.{norm, mixer.*}, backbone.norm_f, lm_head).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from pagoda.attention.backends import AttentionBackend
from pagoda.forward_context import ForwardContext
from pagoda.model.layers.embedding import VocabParallelEmbedding
from pagoda.model.layers.layernorm import RMSNorm, add_and_norm
from pagoda.model.layers.mamba.mixer import MambaMixer2, MambaMixerShape
from pagoda.model.models.state_space import StateSpaceLMBase


class Mamba2Block(nn.Module):
    def __init__(self, shape: MambaMixerShape, eps: float, prefix: str) -> None:
        super().__init__()
        self.norm = RMSNorm(shape.hidden_size, eps)
        self.mixer = MambaMixer2(shape, layer_name=f"{prefix}.mixer")

    def forward(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None, context: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = add_and_norm(self.norm, hidden_states, residual)
        return self.mixer(hidden_states, context), residual


class Mamba2Backbone(nn.Module):
    is_first_stage = is_last_stage = True

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        shape = MambaMixerShape.of_mamba2(config)
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Mamba2Block(shape, config.layer_norm_epsilon, f"backbone.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)

    def get_input_embeddings(self) -> VocabParallelEmbedding:
        return self.embeddings

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        """`positions` are unused: the state carries the order."""
        hidden_states, residual = self.embeddings(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, context)
        hidden_states, _ = self.norm_f(hidden_states, residual)
        return hidden_states


class Mamba2ForCausalLM(StateSpaceLMBase):
    body_name = "backbone"
    renamed = (("backbone.embedding.", "backbone.embeddings."),)

    @classmethod
    def build_body(cls, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> nn.Module:
        return Mamba2Backbone(config)
