"""The Llama-style decoder that Llama, Mistral, Qwen2 and Qwen3 share.

pre-norm blocks of (attention with RoPE and GQA, SwiGLU MLP), tokens flat: T tokens of many
requests concatenated, with the step's `ForwardContext` giving each attention layer its cache
and metadata (which tokens are whose). The models
differ only in `DecoderOptions` (biases, per-head q/k norm), chosen from the HF config by each
subclass's `decoder_options`.

Under pipeline parallelism each stage builds only its own layers (the others are
`PPMissingLayer` placeholders, so parameter names keep their HF layer indices); the first
stage owns the embedding, the last the final norm and the LM head. A stage that is not last
returns `IntermediateTensors` for the next instead of hidden states.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from pagoda.attention.backends import AttentionBackend
from pagoda.attention.layer import Attention
from pagoda.distributed.parallel_state import get_parallel_state, get_pp_layer_range
from pagoda.forward_context import ForwardContext
from pagoda.model.layers.activation import SiluAndMul
from pagoda.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagoda.model.layers.layernorm import RMSNorm, add_and_norm
from pagoda.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagoda.model.layers.quantization.kv_cache import is_kv_scale, load_kv_scale
from pagoda.model.layers.rotary import RotaryEmbedding, rope_settings, rotate_qkv
from pagoda.model.layers.weight_utils import load_checkpoint_weight
from pagoda.outputs import IntermediateTensors

# (our merged parameter, the HF checkpoint name merged into it, its shard id)
StackedParams = tuple[tuple[str, str, int | str], ...]
STACKED_PARAMS: StackedParams = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


def stacked_param_name(hf_name: str, stacked_params: StackedParams = STACKED_PARAMS) -> tuple[str, int | str | None]:
    """Our parameter for checkpoint tensor `hf_name`, and the shard of it the tensor fills (None: all)."""
    for ours, hf, shard_id in stacked_params:
        if f".{hf}." in hf_name:
            return hf_name.replace(f".{hf}.", f".{ours}."), shard_id
    return hf_name, None


def checkpoint_names(name: str, stacked_params: StackedParams = STACKED_PARAMS) -> list[str]:
    """The checkpoint tensors that fill our parameter `name` (one per shard of a merged one)."""
    merged = [name.replace(f".{ours}.", f".{hf}.") for ours, hf, _ in stacked_params if f".{ours}." in name]
    return merged or [name]


def is_derived_weight(hf_name: str, tie_word_embeddings: bool) -> bool:
    """A checkpoint tensor no parameter takes: RoPE's inverse frequencies (recomputed) or, with
    tied embeddings, the LM head (the embedding's)."""
    return hf_name.endswith("rotary_emb.inv_freq") or (tie_word_embeddings and hf_name == "lm_head.weight")


# The checkpoint tensor that both embeds tokens and, with tied embeddings, computes logits.
TIED_EMBEDDING = "model.embed_tokens.weight"
# Its module's prefix: with tied embeddings, its tensors (the weight, or GGUF blocks) are the head's.
EMBEDDING_PREFIX = "model.embed_tokens."


@dataclass(frozen=True)
class DecoderOptions:
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False


class PPMissingLayer(nn.Identity):
    """Stands where a module of another pipeline stage would be; holds no parameters."""


def head_size_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_sliding_window(config: PretrainedConfig, layer_idx: int) -> int | None:
    """The attention window of layer `layer_idx`, None for full attention: `layer_types` where
    the config lists them (Qwen2, Gemma), else `sliding_window` on every layer (Mistral)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window if getattr(config, "use_sliding_window", True) else None


class DecoderAttention(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        options: DecoderOptions,
        attn_backend: type[AttentionBackend],
        layer_idx: int,
        prefix: str,
    ) -> None:
        super().__init__()
        self.head_size = head_size_of(config)
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_size, config.num_attention_heads, num_kv_heads, bias=options.qkv_bias
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_size, config.hidden_size, bias=options.o_proj_bias
        )
        if options.qk_norm:
            self.q_norm = RMSNorm(self.head_size, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_size, config.rms_norm_eps)
        self.qk_norm = options.qk_norm
        self.attn = Attention(
            self.qkv_proj.num_heads,
            self.head_size,
            self.qkv_proj.num_kv_heads,
            self.head_size**-0.5,
            attn_backend,
            layer_name=f"{prefix}.attn",
            sliding_window=layer_sliding_window(config, layer_idx),
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        context: ForwardContext,
    ) -> torch.Tensor:
        q, k, v = rotate_qkv(
            self.qkv_proj(hidden_states),
            *cos_sin,
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            self.head_size,
            (self.q_norm, self.k_norm) if self.qk_norm else None,
        )
        return self.o_proj(self.attn(q, k, v, context))


class DecoderMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, options: DecoderOptions) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu'")
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias=options.mlp_bias)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=options.mlp_bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        options: DecoderOptions,
        attn_backend: type[AttentionBackend],
        layer_idx: int,
        prefix: str,
        mlp: nn.Module | None = None,
    ) -> None:
        """`mlp` replaces the dense SwiGLU MLP (a mixture of experts); None keeps it."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, options, attn_backend, layer_idx, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp if mlp is not None else DecoderMLP(config, options)

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        context: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, the residual stream before it); their sum is the stream after."""
        hidden_states, residual = add_and_norm(self.input_layernorm, hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, cos_sin, context)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class DecoderModel(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        options: DecoderOptions,
        attn_backend: type[AttentionBackend],
        prefix: str,
        build_mlp: Callable[[int], nn.Module | None] | None = None,
    ) -> None:
        """`build_mlp(layer_idx)` gives a layer's MLP in place of the dense one (None: dense)."""
        super().__init__()
        state = get_parallel_state()
        self.is_first_stage, self.is_last_stage = state.is_first_pp_rank, state.is_last_pp_rank
        self.start_layer, self.end_layer = get_pp_layer_range(config.num_hidden_layers)
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size) if self.is_first_stage else PPMissingLayer()
        )
        theta, scaling = rope_settings(config)
        self.rotary_emb = RotaryEmbedding(head_size_of(config), config.max_position_embeddings, theta, scaling)
        self.layers = nn.ModuleList(
            DecoderLayer(
                config, options, attn_backend, i, f"{prefix}.layers.{i}", mlp=build_mlp(i) if build_mlp else None
            )
            if self.start_layer <= i < self.end_layer
            else PPMissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.is_last_stage else PPMissingLayer()
        # EAGLE-3 heads read the residual stream entering these layers: copied, side by side, into
        # `aux_hidden_states` ([max tokens, len(layers) x hidden], a static buffer its proposer sets).
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.aux_hidden_states: torch.Tensor | None = None
        # A whole decode step in one call (the CPU's, `pagoda.model.cpu_decode.attach`): given the
        # step's ids, positions and context, the final norm's output, or None where it does not apply.
        self.fused_decode: Callable[[torch.Tensor, torch.Tensor, ForwardContext], torch.Tensor | None] | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        context: ForwardContext,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """`context` holds this stage's layers only; `intermediate_tensors` feeds every stage but the first;
        `inputs_embeds` replaces the token embeddings (a multimodal model's, with its images in), and
        `cos_sin` the rotary embedding of `positions` (M-RoPE's, where image tokens rotate in 3D)."""
        if self.fused_decode is not None and inputs_embeds is None and cos_sin is None:
            hidden_states = self.fused_decode(input_ids, positions, context)
            if hidden_states is not None:
                return hidden_states
        if self.is_first_stage:
            hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            assert intermediate_tensors is not None, "a later pipeline stage starts from the previous one's tensors"
            hidden_states, residual = intermediate_tensors.hidden_states, intermediate_tensors.residual
        if cos_sin is None:
            cos_sin = self.rotary_emb(positions)
        for index, layer in enumerate(self.layers[self.start_layer : self.end_layer], self.start_layer):
            if index in self.aux_hidden_state_layers:
                self._save_aux_hidden_state(index, hidden_states if residual is None else hidden_states + residual)
            hidden_states, residual = layer(hidden_states, residual, cos_sin, context)
        if not self.is_last_stage:
            return IntermediateTensors(hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def _save_aux_hidden_state(self, layer_index: int, stream: torch.Tensor) -> None:
        assert self.aux_hidden_states is not None
        width = stream.shape[-1]
        for slot, index in enumerate(self.aux_hidden_state_layers):
            if index == layer_index:
                self.aux_hidden_states[: stream.shape[0], slot * width : (slot + 1) * width].copy_(stream)


class DecoderForCausalLM(nn.Module):
    """Base of the causal-LM classes; subclasses pick their `DecoderOptions`."""

    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        self.config = config
        self.model = self.build_model(config, attn_backend)
        is_first_stage, is_last_stage = self.model.is_first_stage, self.model.is_last_stage
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size) if is_last_stage else PPMissingLayer()
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings and is_first_stage and is_last_stage:
            self.lm_head.tie_to(self.model.embed_tokens)
        # Names of modules another pipeline stage holds: their checkpoint weights are skipped.
        self._other_stage_prefixes = tuple(
            f"{name}." for name, module in self.named_modules() if isinstance(module, PPMissingLayer)
        )

    @classmethod
    def build_model(cls, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> nn.Module:
        """The layer stack under "model": a `DecoderModel` here; families whose blocks differ (Gemma)
        return their own, with the same `is_first_stage`, `is_last_stage` and `embed_tokens`."""
        return DecoderModel(config, cls.decoder_options(config), attn_backend, "model")

    @classmethod
    def decoder_options(cls, config: PretrainedConfig) -> DecoderOptions:
        """Llama's: `attention_bias` on q/k/v/o, `mlp_bias` on the MLP (both absent in Mistral)."""
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(
            qkv_bias=attention_bias, o_proj_bias=attention_bias, mlp_bias=bool(getattr(config, "mlp_bias", False))
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        context: ForwardContext,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """input_ids, positions [T] int64 -> hidden states [T, hidden] (last pipeline stage)
        or the tensors the next stage starts from."""
        return self.model(input_ids, positions, context, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden states [N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load (HF name, full tensor) pairs, each rank keeping its slice; returns the HF names loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if is_derived_weight(hf_name, self.tie_word_embeddings):
                continue
            name, shard_id = stacked_param_name(hf_name)
            if name.startswith(EMBEDDING_PREFIX) and name not in params and self.tie_word_embeddings:
                # A last stage without the embedding still needs its rows.
                name = name.replace(EMBEDDING_PREFIX, "lm_head.", 1)
            if name.startswith(self._other_stage_prefixes):
                continue
            if name not in params and is_kv_scale(name):
                load_kv_scale(self, name, tensor)
                loaded.add(hf_name)
                continue
            if name not in params:
                raise ValueError(f"checkpoint weight {hf_name!r} has no parameter in {type(self).__name__}")
            load_checkpoint_weight(params[name], tensor, hf_name, shard_id)
            loaded.add(hf_name)
        return loaded

    def expected_weight_names(self) -> set[str]:
        """The HF names `load_weights` must see for every parameter to be filled."""
        names = set()
        for name, _ in self.named_parameters():
            if name.startswith("lm_head.") and self.tie_word_embeddings:
                name = name.replace("lm_head.", EMBEDDING_PREFIX, 1)
            names.update(checkpoint_names(name))
        return names
