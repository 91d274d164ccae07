"""A mixture-of-experts MLP: a router picks top-k experts per token, the experts' SwiGLU MLPs
run on the tokens routed to them, and their outputs are summed with the routing weights.

The experts' weights are stacked, `w13` [E, 2I, H] (each expert's gate rows, then its up rows)
and `w2` [E, H, I], so that one grouped GEMM serves every expert (the Triton kernel of
`ops.triton_fused_moe` on CUDA, `experts_reference` elsewhere). Tensor parallelism splits each
expert's intermediate dimension I: every rank holds all experts, its slice of each, and the
summed outputs are all-reduced once, as a row-parallel layer does.

How the weights are held and multiplied is the layer's `FusedMoEMethod` (passed down from
`SparseMoeBlock`): unquantized here; a quantized method (FP8 experts with their scales)
creates other parameters (the weights sliced by the same loader, scales by their own) and
makes its own kernel call through the same two methods, leaving the router and the models as
they are.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TypeAlias

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.distributed.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from pagoda.model import ops
from pagoda.model.layers.linear import divide
from pagoda.model.layers.quantization.base import current_moe_method
from pagoda.model.layers.weight_utils import CheckpointWeight, copy_weight, narrow_weight

if ops.TRITON_AVAILABLE:
    from pagoda.model.ops.triton_fused_moe import fused_experts

# Which checkpoint tensor a load fills: (expert, projection), expert None for a tensor of every
# expert stacked (transformers 5's fused layout). Projections: "gate", "up", "down", and the
# fused layout's "gate_up" (gate rows, then up rows).
ExpertShard: TypeAlias = tuple[int | None, str]
# The parameter each projection loads into.
PARAM_OF_PROJECTION = {"gate": "w13_weight", "up": "w13_weight", "gate_up": "w13_weight", "down": "w2_weight"}


@dataclass(frozen=True)
class ExpertNames:
    """A family's checkpoint names of each expert's projections, `experts.{e}.{name}.weight`."""

    gate: str
    up: str
    down: str

    def projection(self, name: str) -> str | None:
        """The projection ("gate", "up", "down") a checkpoint name stands for, None if none."""
        return {self.gate: "gate", self.up: "up", self.down: "down"}.get(name)


@dataclass(frozen=True)
class Routing:
    """How router logits become each token's top-k experts and weights.

    softmax_first: softmax over all experts, then the top k probabilities (Qwen3-MoE), renormalized
    to sum to 1 if `renormalize`; otherwise the top k logits, then a softmax over those (Mixtral:
    the same as renormalizing the top k of the full softmax)."""

    top_k: int
    softmax_first: bool
    renormalize: bool = False


def select_experts(router_logits: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32)."""
    logits = router_logits.float()
    if routing.softmax_first:
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), routing.top_k, dim=-1)
        if routing.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        top_logits, ids = torch.topk(logits, routing.top_k, dim=-1)
        weights = torch.softmax(top_logits, dim=-1)
    return weights, ids.to(torch.int32)


def experts_reference(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """What `fused_experts` computes, in torch ops and HF's order: each expert that got tokens in
    turn (ascending), its weighted outputs added into a float32 sum. Syncs with the host (the
    expert loop), so it is the CPU path and the kernel's reference, not a CUDA-graph path."""
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1).long()
    flat_weights = topk_weights.reshape(-1, 1).float()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    out = torch.zeros(num_tokens, hidden_states.shape[1], dtype=torch.float32, device=hidden_states.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = order[start : start + count]
        start += count
        tokens = rows // top_k
        gate, up = F.linear(hidden_states[tokens], w13[expert]).chunk(2, dim=-1)
        expert_out = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, tokens, expert_out.float() * flat_weights[rows])
    return out.to(hidden_states.dtype)


class FusedMoEMethod(ABC):
    """How a `FusedMoE` layer holds its experts' weights and multiplies by them."""

    @abstractmethod
    def create_weights(self, layer: FusedMoE) -> None:
        """Register the layer's parameters (each with `weight_loader = layer.weight_loader`)."""

    @abstractmethod
    def apply(
        self, layer: FusedMoE, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """This rank's weighted sum of the routed experts' outputs [T, H], before the all-reduce."""

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        """Convert the loaded weights into the kernel's form (quantize), once after loading."""
        del layer


class UnquantizedFusedMoEMethod(FusedMoEMethod):
    """Weights in the model dtype: `w13_weight` [E, 2I/tp, H] and `w2_weight` [E, H, I/tp]."""

    def create_weights(self, layer: FusedMoE) -> None:
        shapes = {
            "w13_weight": (layer.num_experts, 2 * layer.intermediate_per_rank, layer.hidden_size),
            "w2_weight": (layer.num_experts, layer.hidden_size, layer.intermediate_per_rank),
        }
        for name, shape in shapes.items():
            param = nn.Parameter(torch.empty(*shape), requires_grad=False)
            param.weight_loader = layer.weight_loader
            layer.register_parameter(name, param)

    def apply(
        self, layer: FusedMoE, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        if ops.use_triton(hidden_states):
            return fused_experts(hidden_states, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)
        return experts_reference(hidden_states, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)


class FusedMoE(nn.Module):
    """The experts of one MoE layer, stacked, each split over the tensor-parallel ranks along its
    intermediate dimension; `forward` takes the router's choice and returns the all-reduced sum."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        names: ExpertNames,
        method: FusedMoEMethod | None = None,
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.intermediate_per_rank = divide(intermediate_size, self.tp_size)
        self.names = names
        self.method = method or current_moe_method() or UnquantizedFusedMoEMethod()
        self.method.create_weights(self)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def weight_loader(self, param: nn.Parameter, loaded_weight: CheckpointWeight, shard_id: ExpertShard) -> None:
        """Copy this rank's slice of one checkpoint tensor (see `ExpertShard`) into `param`."""
        expert, projection = shard_id
        if projection not in PARAM_OF_PROJECTION:
            raise ValueError(f"unknown expert projection {projection!r}, expected one of {list(PARAM_OF_PROJECTION)}")
        if expert is not None and not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range: the layer has num_experts={self.num_experts}")
        size, full = self.intermediate_per_rank, self.intermediate_size
        # The dimension of I in the checkpoint tensor: per expert [I, H] or [H, I], stacked [E, ...].
        dim = (1 if projection == "down" else 0) + (0 if expert is not None else 1)
        expected = 2 * full if projection == "gate_up" else full
        stacked = () if expert is not None else (self.num_experts,)
        if loaded_weight.ndim != len(stacked) + 2 or loaded_weight.shape[dim] != expected:
            raise ValueError(
                f"checkpoint tensor shape {tuple(loaded_weight.shape)} does not fit expert projection "
                f"{projection!r}: expected {len(stacked) + 2} dims with intermediate size {expected} in dim {dim}"
            )
        dst = param.data if expert is None else param.data[expert]
        if projection == "down":
            copy_weight(dst, narrow_weight(loaded_weight, dim, self.tp_rank * size, size))
            return
        # (row offset in the checkpoint tensor, row offset in w13) of each half it holds
        halves = {"gate": [(0, 0)], "up": [(0, size)], "gate_up": [(0, 0), (full, size)]}[projection]
        for src_offset, dst_offset in halves:
            part = narrow_weight(loaded_weight, dim, src_offset + self.tp_rank * size, size)
            copy_weight(dst.narrow(dim, dst_offset, size), part)

    def checkpoint_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """HF name -> full shape of each expert's projections in the published per-expert layout,
        this module being `prefix` ("model.layers.0.mlp.experts")."""
        hidden, full = self.hidden_size, self.intermediate_size
        shapes = {}
        for expert in range(self.num_experts):
            shapes[f"{prefix}.{expert}.{self.names.gate}.weight"] = (full, hidden)
            shapes[f"{prefix}.{expert}.{self.names.up}.weight"] = (full, hidden)
            shapes[f"{prefix}.{expert}.{self.names.down}.weight"] = (hidden, full)
        return shapes

    def checkpoint_names_filled(self, prefix: str, shard_id: ExpertShard) -> set[str]:
        """The per-expert checkpoint names a tensor of `shard_id` stands for (all experts' for a
        stacked one), so that either layout completes the same expected names."""
        expert, projection = shard_id
        experts = range(self.num_experts) if expert is None else [expert]
        names = {"gate": [self.names.gate], "up": [self.names.up], "down": [self.names.down]}
        leaves = names.get(projection, [self.names.gate, self.names.up])
        return {f"{prefix}.{e}.{leaf}.weight" for e in experts for leaf in leaves}

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, hidden_states, topk_weights, topk_ids)
        return tensor_model_parallel_all_reduce(out)


class SparseMoeBlock(nn.Module):
    """The router (`gate`, a replicated [E, H] linear) and the experts: what replaces the dense
    MLP in a decoder layer, named as HF names it (`mlp.gate`, `mlp.experts`)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        intermediate_size: int,
        routing: Routing,
        names: ExpertNames,
        method: FusedMoEMethod | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= routing.top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({routing.top_k}) must be in [1, num_experts={num_experts}]")
        self.routing = routing
        self.gate = Router(hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, names, method)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(self.gate(hidden_states), self.routing)
        return self.experts(hidden_states, topk_weights, topk_ids)


class Router(nn.Module):
    """logits [T, E] = x W^T, W [E, H] held whole by every rank."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight)
