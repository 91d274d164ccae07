"""Mixtral: Mistral's attention, and in every layer `num_local_experts` experts of which each token
takes the top `num_experts_per_tok` by router logit, weighted by a softmax over those logits.

Published checkpoints name the MoE block `block_sparse_moe` and each expert's projections
w1 (gate), w3 (up), w2 (down); transformers 5 calls the block `mlp`, as we do."""

from __future__ import annotations

from transformers import PretrainedConfig

from pagoda.model.layers.fused_moe import ExpertNames, Routing
from pagoda.model.models.moe import MoeForCausalLM, MoeSpec


class MixtralForCausalLM(MoeForCausalLM):
    """No biases: the decoder's default options."""

    checkpoint_aliases = ((".block_sparse_moe.", ".mlp."),)

    @classmethod
    def moe_spec(cls, config: PretrainedConfig) -> MoeSpec:
        return MoeSpec(
            num_experts=config.num_local_experts,
            intermediate_size=config.intermediate_size,
            routing=Routing(config.num_experts_per_tok, softmax_first=False),
            names=ExpertNames(gate="w1", up="w3", down="w2"),
            sparse_layers=frozenset(range(config.num_hidden_layers)),
        )
