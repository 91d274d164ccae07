"""Helpers of the LoRA tests: random PEFT adapters saved by `peft` over a tiny HF model, and
the HF + peft reference (the adapter applied, or merged into the weights)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from peft import LoraConfig, PeftModel, get_peft_model

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...] = ALL_TARGETS
    use_rslora: bool = False


# Ranks, scalings and targets that differ: all seven projections, attention or MLP only, q/v
# only, rsLoRA; the highest rank is max_lora_rank.
ADAPTER_SPECS = (
    AdapterSpec(rank=8, alpha=16),
    AdapterSpec(rank=16, alpha=8, targets=("q_proj", "k_proj", "v_proj", "o_proj")),
    AdapterSpec(rank=4, alpha=8, targets=("gate_proj", "up_proj", "down_proj"), use_rslora=True),
    AdapterSpec(rank=2, alpha=4, targets=("q_proj", "v_proj")),
)
MAX_LORA_RANK = 16


@torch.no_grad()
def save_random_adapter(base: torch.nn.Module, spec: AdapterSpec, path: str, seed: int) -> None:
    """A PEFT adapter of `spec` over (a copy of) `base`, its A and B drawn N(0, 0.3) (PEFT's own
    init leaves B zero: no effect), saved with `save_pretrained`."""
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        use_rslora=spec.use_rslora,
        lora_dropout=0.0,
        bias="none",
    )
    model = get_peft_model(copy.deepcopy(base), config)
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    model.save_pretrained(path)


def peft_model(base: torch.nn.Module, path: str, merged: bool) -> torch.nn.Module:
    """`base` with the adapter at `path` applied by peft, or merged into a copy of the weights."""
    model = PeftModel.from_pretrained(copy.deepcopy(base), path)
    model.eval()
    return model.merge_and_unload() if merged else model
