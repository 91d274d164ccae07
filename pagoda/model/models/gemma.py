"""Gemma 2 and Gemma 3 (text): the decoder's projections and weight loading, Gemma's blocks.

What differs from the Llama-style decoder, each as HF computes it:
- token embeddings are scaled by sqrt(hidden_size), rounded to the model dtype first;
- `GemmaRMSNorm` (x * (1 + weight), in float32), four per layer: the attention and the MLP
  outputs are each normalized again before they join the residual stream;
- a GELU (tanh) gated MLP;
- attention scaled by `query_pre_attn_scalar ** -0.5`, sliding-window and global layers as
  `layer_types` lists them; Gemma 2 soft-caps attention scores (`attn_logit_softcapping`);
- Gemma 3 normalizes each q and k head (`q_norm`, `k_norm`) before RoPE and rotates local
  (sliding) and global layers with their own RoPE: in transformers 5 `rope_parameters` holds one
  set per layer type, older configs `rope_local_base_freq` (local, unscaled) and `rope_theta` +
  `rope_scaling` (global);
- logits soft-capped by `final_logit_softcapping`: cap * tanh(logits / cap).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from pagoda.attention.backends import AttentionBackend
from pagoda.attention.layer import Attention
from pagoda.distributed.parallel_state import get_parallel_state, get_pp_layer_range
from pagoda.forward_context import ForwardContext
from pagoda.model.layers.activation import GeluAndMul
from pagoda.model.layers.embedding import VocabParallelEmbedding
from pagoda.model.layers.layernorm import GemmaRMSNorm, add_and_norm
from pagoda.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagoda.model.layers.rotary import RotaryEmbedding, apply_rotary, rope_settings, rotate_qkv
from pagoda.model.models.decoder import DecoderForCausalLM, PPMissingLayer, head_size_of, layer_sliding_window
from pagoda.outputs import IntermediateTensors

SLIDING, FULL = "sliding_attention", "full_attention"

# HF `hidden_activation` -> torch's GELU `approximate`
_GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


def _layer_types(config: PretrainedConfig) -> list[str]:
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None or len(layer_types) != config.num_hidden_layers:
        raise ValueError(f"{config.model_type}: config.layer_types must list the type of each of the layers")
    unknown = set(layer_types) - {SLIDING, FULL}
    if unknown:
        raise ValueError(f"{config.model_type}: layer types {sorted(unknown)} are not supported")
    return list(layer_types)


def _gemma3_rope_settings(config: PretrainedConfig, layer_type: str) -> tuple[float, dict[str, Any]]:
    """(theta, scaling) of Gemma 3's local (sliding) or global layers, from either config layout."""
    parameters = getattr(config, "rope_parameters", None)
    if parameters and layer_type in parameters:  # transformers 5: one set per layer type
        return rope_settings(SimpleNamespace(rope_parameters=parameters[layer_type]))
    if layer_type == SLIDING:  # transformers 4: local layers use their own base, never scaled
        return float(getattr(config, "rope_local_base_freq", 10000.0)), {"rope_type": "default"}
    return rope_settings(
        SimpleNamespace(
            rope_theta=getattr(config, "rope_theta", 1_000_000.0), rope_scaling=getattr(config, "rope_scaling", None)
        )
    )


def _round_to_dtype(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=dtype))


class GemmaAttention(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        attn_backend: type[AttentionBackend],
        layer_idx: int,
        prefix: str,
        qk_norm: bool,
        logits_soft_cap: float | None,
    ) -> None:
        super().__init__()
        self.head_size = head_size_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_size, config.num_attention_heads, config.num_key_value_heads, bias=bias
        )
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_size, config.hidden_size, bias=bias)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_size, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_size, config.rms_norm_eps)
        self.attn = Attention(
            self.qkv_proj.num_heads,
            self.head_size,
            self.qkv_proj.num_kv_heads,
            config.query_pre_attn_scalar**-0.5,
            attn_backend,
            layer_name=f"{prefix}.attn",
            sliding_window=layer_sliding_window(config, layer_idx),
            logits_soft_cap=logits_soft_cap,
        )

    def forward(
        self, hidden_states: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], context: ForwardContext
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        num_heads, num_kv_heads, head_size = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, self.head_size
        if not self.qk_norm:
            q, k, v = rotate_qkv(qkv, *cos_sin, num_heads, num_kv_heads, head_size)
        else:
            # Gemma's norm is not the fused kernel's (Llama's): normalize here, then rotate.
            num_tokens = qkv.shape[0]
            q, k, v = qkv.split([num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], dim=-1)
            q = self.q_norm(q.reshape(num_tokens, num_heads, head_size)).view(num_tokens, -1)
            k = self.k_norm(k.reshape(num_tokens, num_kv_heads, head_size)).view(num_tokens, -1)
            q, k = apply_rotary(q, *cos_sin, head_size), apply_rotary(k, *cos_sin, head_size)
        return self.o_proj(self.attn(q, k, v, context))


class GemmaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        activation = getattr(config, "hidden_activation", None) or config.hidden_act
        if activation not in _GELU_APPROXIMATIONS:
            raise ValueError(
                f"hidden_activation {activation!r} is not supported; supported: {list(_GELU_APPROXIMATIONS)}"
            )
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias=False)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=False)
        self.act_fn = GeluAndMul(_GELU_APPROXIMATIONS[activation])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        attn_backend: type[AttentionBackend],
        layer_idx: int,
        prefix: str,
        qk_norm: bool,
        logits_soft_cap: float | None,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = GemmaAttention(
            config, attn_backend, layer_idx, f"{prefix}.self_attn", qk_norm=qk_norm, logits_soft_cap=logits_soft_cap
        )
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = GemmaMLP(config)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        context: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, the residual stream before it); their sum is the stream
        after. HF's `residual + post_norm(block(pre_norm(x)))`, with each add fused into the next norm."""
        hidden_states, residual = add_and_norm(self.input_layernorm, hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(hidden_states, cos_sin, context))
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class GemmaModel(nn.Module):
    """Gemma 2 (`gemma3=False`: one RoPE, attention soft-cap) or Gemma 3 text (q/k norms, local
    and global RoPE); pipeline stages as in `DecoderModel`."""

    def __init__(
        self, config: PretrainedConfig, attn_backend: type[AttentionBackend], prefix: str, gemma3: bool
    ) -> None:
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(f"{config.model_type}: use_bidirectional_attention (an encoder) is not supported")
        state = get_parallel_state()
        self.is_first_stage, self.is_last_stage = state.is_first_pp_rank, state.is_last_pp_rank
        self.start_layer, self.end_layer = get_pp_layer_range(config.num_hidden_layers)
        self.layer_types = _layer_types(config)
        self.embed_scale = config.hidden_size**0.5
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size) if self.is_first_stage else PPMissingLayer()
        )
        head_size, max_position = head_size_of(config), config.max_position_embeddings
        if gemma3:
            self.rotary_emb = RotaryEmbedding(head_size, max_position, *_gemma3_rope_settings(config, FULL))
            self.rotary_emb_local = RotaryEmbedding(head_size, max_position, *_gemma3_rope_settings(config, SLIDING))
        else:
            self.rotary_emb = RotaryEmbedding(head_size, max_position, *rope_settings(config))
            self.rotary_emb_local = None
        # Gemma 3's config carries attn_logit_softcapping, but HF's Gemma 3 never applies it.
        soft_cap = None if gemma3 else getattr(config, "attn_logit_softcapping", None)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, attn_backend, i, f"{prefix}.layers.{i}", qk_norm=gemma3, logits_soft_cap=soft_cap)
            if self.start_layer <= i < self.end_layer
            else PPMissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps) if self.is_last_stage else PPMissingLayer()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        context: ForwardContext,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if self.is_first_stage:
            hidden_states = self.embed_tokens(input_ids)
            # HF multiplies by the normalizer cast to the hidden dtype (sqrt(3072) is 55.5 in bf16).
            hidden_states, residual = hidden_states * _round_to_dtype(self.embed_scale, hidden_states.dtype), None
        else:
            assert intermediate_tensors is not None, "a later pipeline stage starts from the previous one's tensors"
            hidden_states, residual = intermediate_tensors.hidden_states, intermediate_tensors.residual
        cos_sin = self.rotary_emb(positions)
        cos_sin_local = cos_sin if self.rotary_emb_local is None else self.rotary_emb_local(positions)
        for i in range(self.start_layer, self.end_layer):
            layer_cos_sin = cos_sin_local if self.layer_types[i] == SLIDING else cos_sin
            hidden_states, residual = self.layers[i](hidden_states, residual, layer_cos_sin, context)
        if not self.is_last_stage:
            return IntermediateTensors(hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Gemma2ForCausalLM(DecoderForCausalLM):
    """The decoder's LM head, tying and weight loading (HF names, q/k/v and gate/up merged) over
    Gemma's layer stack; logits soft-capped by `final_logit_softcapping`."""

    gemma3 = False

    @classmethod
    def build_model(cls, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> nn.Module:
        return GemmaModel(config, attn_backend, "model", gemma3=cls.gemma3)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden states [N, hidden] -> float32 logits [N, vocab], capped in float32."""
        logits = super().compute_logits(hidden_states)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text-only (HF `Gemma3ForCausalLM`, model_type "gemma3_text")."""

    gemma3 = True
