"""Bamba (`BambaForCausalLM`): Mamba-2 mixers interleaved with a few attention layers.

The hybrid we serve because its parts are the ones Pagoda has: its mixer is HF's Mamba-2 mixer
(the same weights and math as `Mamba2ForCausalLM`), its attention Llama's (GQA, RoPE on the
first `partial_rotary_factor` of each head, no bias) and its MLP the SwiGLU decoder's, so a
hybrid layout (a full-attention KV-cache group beside the state groups, one pool) is what is
new. It is the layout of IBM's Granite-4.0-H (GraniteMoeHybrid adds MoE and multipliers).

Layer i is `config.layers_block_type[i]`: "linear_attention" (a `MambaMixer2` under
`model.layers.i.mamba`) or "full_attention" (`model.layers.i.self_attn`); every layer has
`input_layernorm`, `pre_ff_layernorm` and `feed_forward`.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from pagoda.attention.backends import AttentionBackend
from pagoda.attention.layer import Attention
from pagoda.config import ConfigError
from pagoda.forward_context import ForwardContext
from pagoda.model.layers.embedding import VocabParallelEmbedding
from pagoda.model.layers.layernorm import RMSNorm, add_and_norm
from pagoda.model.layers.linear import QKVParallelLinear, RowParallelLinear
from pagoda.model.layers.mamba.mixer import MambaMixer2, MambaMixerShape
from pagoda.model.layers.rotary import RotaryEmbedding, apply_rotary, rope_settings
from pagoda.model.models.decoder import STACKED_PARAMS, DecoderMLP, DecoderOptions, head_size_of
from pagoda.model.models.state_space import StateSpaceLMBase

LAYER_TYPES = ("linear_attention", "full_attention")


def rotary_dim_of(config: PretrainedConfig) -> int:
    """The leading channels of each head that RoPE rotates (an even count)."""
    _, scaling = rope_settings(config)
    rotary_dim = int(head_size_of(config) * scaling.get("partial_rotary_factor", 1.0))
    if rotary_dim < 2 or rotary_dim % 2:
        raise ConfigError(f"partial_rotary_factor gives {rotary_dim} rotary channels per head; must be even and >= 2")
    return rotary_dim


def rotate_leading(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int, rotary_dim: int):
    """x [T, heads * head_size] with RoPE applied to the first `rotary_dim` channels of each head."""
    heads = x.view(x.shape[0], -1, head_size)
    rotated = apply_rotary(heads[..., :rotary_dim].reshape(x.shape[0], -1), cos, sin, rotary_dim)
    return torch.cat((rotated.view(*heads.shape[:2], rotary_dim), heads[..., rotary_dim:]), dim=-1).view_as(x)


class BambaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend], prefix: str) -> None:
        super().__init__()
        self.head_size = head_size_of(config)
        self.rotary_dim = rotary_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_size, config.num_attention_heads, config.num_key_value_heads, bias=bias
        )
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_size, config.hidden_size, bias=bias)
        self.attn = Attention(
            self.qkv_proj.num_heads,
            self.head_size,
            self.qkv_proj.num_kv_heads,
            self.head_size**-0.5,
            attn_backend,
            layer_name=f"{prefix}.attn",
        )

    def forward(
        self, hidden_states: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], context: ForwardContext
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q_size = self.qkv_proj.num_heads * self.head_size
        kv_size = self.qkv_proj.num_kv_heads * self.head_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = rotate_leading(q, *cos_sin, self.head_size, self.rotary_dim)
        k = rotate_leading(k, *cos_sin, self.head_size, self.rotary_dim)
        return self.o_proj(self.attn(q, k, v.contiguous(), context))


class BambaDecoderLayer(nn.Module):
    def __init__(
        self, config: PretrainedConfig, layer_type: str, attn_backend: type[AttentionBackend], prefix: str
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.mamba = MambaMixer2(MambaMixerShape.of_hybrid(config), layer_name=f"{prefix}.mamba")
        else:
            self.self_attn = BambaAttention(config, attn_backend, f"{prefix}.self_attn")
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = DecoderMLP(config, DecoderOptions(mlp_bias=bool(getattr(config, "mlp_bias", False))))

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        context: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = add_and_norm(self.input_layernorm, hidden_states, residual)
        if self.layer_type == "linear_attention":
            hidden_states = self.mamba(hidden_states, context)
        else:
            hidden_states = self.self_attn(hidden_states, cos_sin, context)
        hidden_states, residual = self.pre_ff_layernorm(hidden_states, residual)
        return self.feed_forward(hidden_states), residual


class BambaModel(nn.Module):
    is_first_stage = is_last_stage = True

    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        layer_types = list(config.layers_block_type)
        unknown = sorted(set(layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ConfigError(f"layers_block_type: {unknown} are not supported; supported: {list(LAYER_TYPES)}")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        theta, scaling = rope_settings(config)
        self.rotary_emb = RotaryEmbedding(rotary_dim_of(config), config.max_position_embeddings, theta, scaling)
        self.layers = nn.ModuleList(
            BambaDecoderLayer(config, layer_type, attn_backend, f"model.layers.{i}")
            for i, layer_type in enumerate(layer_types)
        )
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def get_input_embeddings(self) -> VocabParallelEmbedding:
        return self.embed_tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        cos_sin = self.rotary_emb(positions)
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, cos_sin, context)
        hidden_states, _ = self.final_layernorm(hidden_states, residual)
        return hidden_states


class BambaForCausalLM(StateSpaceLMBase):
    stacked_params = STACKED_PARAMS

    @classmethod
    def build_body(cls, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> nn.Module:
        return BambaModel(config, attn_backend)
