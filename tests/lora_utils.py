"""Helpers of the LoRA tests: random PEFT adapters saved by `peft` over a tiny HF model, and
the HF + peft reference (the adapter applied, or merged into the weights)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from model_utils import assert_greedy_match
from peft import LoraConfig, PeftModel, get_peft_model

from pagoda import LLM, LoRARequest, SamplingParams

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

MAX_TOKENS = 16
MIN_MARGIN = 1e-3
PROMPTS = [list(range(5, 30)), [7, 100, 3, 54, 201, 9, 9, 17, 250, 31, 4]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


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


def generate(llm: LLM, requests: list[tuple[int, LoRARequest | None]]) -> list[list[int]]:
    """Greedy tokens of each (prompt index, adapter) request, all in one `generate` call."""
    outputs = llm.generate(
        [PROMPTS[p] for p, _ in requests], GREEDY, use_tqdm=False, lora_request=[lora for _, lora in requests]
    )
    return [list(o.outputs[0].token_ids) for o in outputs]


def check_against_references(requests, tokens, references) -> None:
    """Each request's tokens are its adapter's HF + peft tokens up to the margin rule."""
    for (p, lora), ours in zip(requests, tokens, strict=True):
        reference, margins = references[lora.lora_int_id if lora else 0, p]
        assert_greedy_match(ours, reference, margins, MIN_MARGIN)
