"""The decoder with mixture-of-experts MLPs (Qwen3-MoE, Mixtral): `DecoderModel`'s layers, each
sparse layer's MLP a `SparseMoeBlock`, and the checkpoint names of the experts' weights.

Checkpoints hold the experts either one tensor per expert and projection, as published
(`mlp.experts.{e}.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.{e}.w1.weight`), or,
as transformers 5 keeps them in memory, all experts stacked (`mlp.experts.gate_up_proj`
[E, 2I, H], `mlp.experts.down_proj` [E, H, I]). Both load into the same stacked parameters;
the names a model expects are the per-expert ones, and a stacked tensor counts as all of them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from pagoda.attention.backends import AttentionBackend
from pagoda.model.layers.fused_moe import (
    PARAM_OF_PROJECTION,
    ExpertNames,
    ExpertShard,
    FusedMoE,
    Routing,
    SparseMoeBlock,
)
from pagoda.model.layers.weight_utils import load_checkpoint_weight
from pagoda.model.models.decoder import DecoderForCausalLM, DecoderModel

_PER_EXPERT = re.compile(r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<leaf>[^.]+)\.weight$")
_STACKED = re.compile(r"^(?P<module>.+\.experts)\.(?P<leaf>gate_up_proj|down_proj)$")
_STACKED_PROJECTIONS = {"gate_up_proj": "gate_up", "down_proj": "down"}


@dataclass(frozen=True)
class MoeSpec:
    """What a family's config says about its experts."""

    num_experts: int
    intermediate_size: int
    routing: Routing
    names: ExpertNames
    sparse_layers: frozenset[int]


class MoeForCausalLM(DecoderForCausalLM):
    """Subclasses give `moe_spec`; `checkpoint_aliases` renames checkpoint name parts to ours."""

    checkpoint_aliases: tuple[tuple[str, str], ...] = ()

    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__(config, attn_backend)
        self._experts = {name: module for name, module in self.named_modules() if isinstance(module, FusedMoE)}

    @classmethod
    def moe_spec(cls, config: PretrainedConfig) -> MoeSpec:
        raise NotImplementedError

    @classmethod
    def build_model(cls, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> nn.Module:
        spec = cls.moe_spec(config)
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu'")

        def build_mlp(layer_idx: int) -> nn.Module | None:
            if layer_idx not in spec.sparse_layers:
                return None
            return SparseMoeBlock(
                config.hidden_size, spec.num_experts, spec.intermediate_size, spec.routing, spec.names
            )

        return DecoderModel(config, cls.decoder_options(config), attn_backend, "model", build_mlp=build_mlp)

    def _expert_target(self, name: str) -> tuple[str, ExpertShard] | None:
        """(experts module name, shard) of an expert checkpoint tensor of this rank's layers."""
        per_expert, stacked = _PER_EXPERT.match(name), _STACKED.match(name)
        match = per_expert or stacked
        if match is None or match["module"] not in self._experts:
            return None
        if stacked:
            return match["module"], (None, _STACKED_PROJECTIONS[match["leaf"]])
        projection = self._experts[match["module"]].names.projection(match["leaf"])
        return (match["module"], (int(match["expert"]), projection)) if projection else None

    def _our_name(self, hf_name: str) -> str:
        for theirs, ours in self.checkpoint_aliases:
            hf_name = hf_name.replace(theirs, ours)
        return hf_name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Expert tensors into the stacked parameters; every other tensor as the decoder loads it."""
        experts_loaded: set[str] = set()

        def others() -> Iterator[tuple[str, torch.Tensor]]:
            for hf_name, tensor in weights:
                name = self._our_name(hf_name)
                target = self._expert_target(name)
                if target is None:
                    yield name, tensor
                    continue
                module_name, shard_id = target
                experts = self._experts[module_name]
                param = getattr(experts, PARAM_OF_PROJECTION[shard_id[1]])
                load_checkpoint_weight(param, tensor, hf_name, shard_id)
                experts_loaded.update(experts.checkpoint_names_filled(module_name, shard_id))

        return super().load_weights(others()) | experts_loaded

    def expected_weight_names(self) -> set[str]:
        names = super().expected_weight_names()
        for module_name, experts in self._experts.items():
            names -= {f"{module_name}.{leaf}" for leaf, _ in experts.named_parameters()}
            names |= experts.checkpoint_shapes(module_name).keys()
        return names
