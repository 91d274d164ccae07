"""EAGLE draft heads for Llama-style targets, built from their published checkpoint layouts.

EAGLE-1 (SafeAILab/EAGLE `cnets.py`; vLLM `llama_eagle.py`): `fc` maps [token embedding; the
target's final hidden state] (2 x hidden) to hidden, then `layers.N` Llama decoder layers (the
first without its input norm); the output is the last layer's residual stream, un-normalized,
and the target's LM head turns it into logits. The embedding is the target's too.

EAGLE-3 (vLLM `llama_eagle3.py`, SGLang `llama_eagle3.py`): `fc` maps three of the target's
hidden states (the residual stream entering a low, a middle and a high layer, concatenated:
3 x the target's hidden) to hidden; one decoder layer `midlayer` whose attention reads
[input_layernorm(embedding); hidden_norm(hidden)] (2 x hidden wide: its q/k/v projections take
twice the hidden size); its own final `norm` and `lm_head` over a draft vocabulary of
`draft_vocab_size` ids, mapped to target ids by `d2t` (target id = draft id + d2t[draft id]).
The embedding is the target's unless the checkpoint brings `embed_tokens.weight`.

Both return (hidden for the logits, hidden for the next draft step): EAGLE-1 the same stream
twice, EAGLE-3 the normalized stream and the stream before its norm. The target's modules they
share are held outside the module tree, so packing or loading the head never touches them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from pagoda.attention.backends import AttentionBackend
from pagoda.forward_context import ForwardContext
from pagoda.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagoda.model.layers.layernorm import RMSNorm
from pagoda.model.layers.linear import QKVParallelLinear
from pagoda.model.layers.rotary import RotaryEmbedding, rope_settings
from pagoda.model.layers.weight_utils import copy_weight, load_checkpoint_weight
from pagoda.model.models.decoder import (
    DecoderAttention,
    DecoderLayer,
    DecoderMLP,
    DecoderOptions,
    checkpoint_names,
    head_size_of,
    stacked_param_name,
)


def eagle3_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """The layers whose incoming residual stream EAGLE-3 reads, when its config names none (vLLM's choice)."""
    return (2, num_target_layers // 2, num_target_layers - 3)


class _EagleHead(nn.Module):
    """What both heads share: the target's embedding (unless the head has its own), RoPE, loading."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        theta, scaling = rope_settings(config)
        self.rotary_emb = RotaryEmbedding(head_size_of(config), config.max_position_embeddings, theta, scaling)
        self._target: tuple[nn.Module, ...] = ()  # (the target model), outside the module tree
        self.embed_tokens: VocabParallelEmbedding | None = None

    def share_target(self, target: nn.Module) -> None:
        self._target = (target,)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        return self._target[0].model.embed_tokens(input_ids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the head's checkpoint tensors (HF names); tensors of what it shares are skipped."""
        params = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name, shard_id = stacked_param_name(hf_name)
            if name in buffers:
                copy_weight(buffers[name], tensor)
                loaded.add(hf_name)
                continue
            if name not in params:
                if name in self.skipped_weights:
                    continue
                raise ValueError(f"checkpoint weight {hf_name!r} has no parameter in {type(self).__name__}")
            load_checkpoint_weight(params[name], tensor, hf_name, shard_id)
            loaded.add(hf_name)
        return loaded

    # Checkpoint tensors the head does not keep (the target's, where the head shares them).
    skipped_weights: frozenset[str] = frozenset({"embed_tokens.weight", "lm_head.weight", "t2d"})

    def expected_weight_names(self) -> set[str]:
        names = set()
        for name in [*(n for n, _ in self.named_parameters()), *(n for n, _ in self.named_buffers())]:
            if name.startswith("rotary_emb."):
                continue
            names.update(checkpoint_names(name))
        return names


class Eagle1Head(_EagleHead):
    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__(config)
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=bool(getattr(config, "eagle_fc_bias", False)))
        options = DecoderOptions(qkv_bias=bool(getattr(config, "attention_bias", False)))
        self.layers = nn.ModuleList(
            DecoderLayer(config, options, attn_backend, i, f"layers.{i}") for i in range(config.num_hidden_layers)
        )
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE-1's first layer has none

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor, context: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = self.fc(torch.cat([self.embed(input_ids), hidden_states], dim=-1))
        cos_sin = self.rotary_emb(positions)
        residual = None
        for layer in self.layers:
            stream, residual = layer(stream, residual, cos_sin, context)
        stream = stream + residual
        return stream, stream

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._target[0].compute_logits(hidden_states)


class Eagle3MidLayer(nn.Module):
    """The one decoder layer of EAGLE-3: attention over [normed embedding; normed hidden]."""

    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, DecoderOptions(), attn_backend, 0, "midlayer.self_attn")
        attn = self.self_attn
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        attn.qkv_proj = QKVParallelLinear(2 * hidden, attn.head_size, config.num_attention_heads, num_kv_heads)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.mlp = DecoderMLP(config, DecoderOptions())

    def forward(
        self,
        embeds: torch.Tensor,
        hidden_states: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        context: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden_states
        attn_input = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden_states)], dim=-1)
        out = self.self_attn(attn_input, cos_sin, context)
        out, residual = self.post_attention_layernorm(out, residual)
        return self.mlp(out), residual


class Eagle3Head(_EagleHead):
    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__(config)
        hidden = config.hidden_size
        target_hidden = getattr(config, "target_hidden_size", None) or hidden
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.fc = nn.Linear(3 * target_hidden, hidden, bias=False)
        self.midlayer = Eagle3MidLayer(config, attn_backend)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))

    skipped_weights = frozenset({"t2d"})

    def expected_weight_names(self) -> set[str]:
        """`d2t` may be absent (a draft vocabulary equal to the target's maps ids to themselves)."""
        return super().expected_weight_names() - {"d2t"}

    def with_own_embedding(self) -> None:
        """The checkpoint brings `embed_tokens.weight`: the head embeds with it, not the target's."""
        self.embed_tokens = VocabParallelEmbedding(self.config.vocab_size, self.config.hidden_size)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor, context: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, residual = self.midlayer(self.embed(input_ids), hidden_states, self.rotary_emb(positions), context)
        return self.norm(out, residual)

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's three hidden states [T, 3 x target hidden] -> the head's input [T, hidden]."""
        return self.fc(hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 logits over the target's vocabulary: -inf outside the draft vocabulary."""
        draft_logits = self.lm_head(hidden_states).float()
        logits = draft_logits.new_full((draft_logits.shape[0], self.config.vocab_size), float("-inf"))
        target_ids = torch.arange(self.draft_vocab_size, device=logits.device) + self.d2t
        logits[:, target_ids] = draft_logits
        return logits
