"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm), and in each sparse layer routed experts
without a shared one: a softmax over all experts, then the top k, renormalized if
`norm_topk_prob`. A layer is sparse unless `mlp_only_layers` lists it, and only every
`decoder_sparse_step`-th layer is (HF's rule); the others keep a dense MLP of `intermediate_size`."""

from __future__ import annotations

from transformers import PretrainedConfig

from pagoda.model.layers.fused_moe import ExpertNames, Routing
from pagoda.model.models.decoder import DecoderOptions
from pagoda.model.models.moe import MoeForCausalLM, MoeSpec


def num_experts_of(config: PretrainedConfig) -> int:
    """`num_experts` (Qwen's name; transformers 5 maps it to `num_local_experts`)."""
    return getattr(config, "num_experts", None) or config.num_local_experts


class Qwen3MoeForCausalLM(MoeForCausalLM):
    @classmethod
    def decoder_options(cls, config: PretrainedConfig) -> DecoderOptions:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(qkv_bias=attention_bias, o_proj_bias=attention_bias, qk_norm=True)

    @classmethod
    def moe_spec(cls, config: PretrainedConfig) -> MoeSpec:
        num_experts = num_experts_of(config)
        dense = set(getattr(config, "mlp_only_layers", None) or [])
        step = getattr(config, "decoder_sparse_step", 1) or 1
        sparse = {
            i for i in range(config.num_hidden_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0
        }
        return MoeSpec(
            num_experts=num_experts,
            intermediate_size=config.moe_intermediate_size,
            routing=Routing(config.num_experts_per_tok, softmax_first=True, renormalize=bool(config.norm_topk_prob)),
            names=ExpertNames(gate="gate_proj", up="up_proj", down="down_proj"),
            sparse_layers=frozenset(sparse),
        )
