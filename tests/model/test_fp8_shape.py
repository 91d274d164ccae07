"""FP8 weights at a published shape (Llama-3.1-8B on the GPU; a 4-layer cut of it on the CPU,
slow): one model with unit-gain random weights (as `save_unit_gain_checkpoint` draws them, so
logits are not flat), its 128-token prefill logits in bf16, then the same model's linear
layers quantized in place exactly as `quantization="fp8"` does at load. Reported: relative L2
error of the logits and greedy top-1 agreement; asserted loosely (LOGIT_REL_TOL,
MIN_TOP1_AGREEMENT): random weights, unlike trained ones, let the rounding of every layer
compound. Measured on the CPU (the same W8A8 numerics as the GPU's 128-token path): 4 layers
0.084 / 0.81, 16 layers 0.146 / 0.66; the 32-layer GPU figure is the lead's to record.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from model_utils import build_attn_metadata, forward_context

from pagoda.attention.backends import AttentionLimits, get_attention_backend
from pagoda.attention.layer import Attention
from pagoda.model.layers.linear import LinearBase
from pagoda.model.layers.quantization.fp8 import Fp8Config
from pagoda.model.loader.dummy import dummy_shape_config
from pagoda.model.registry import get_model_class

LOGIT_REL_TOL = 0.35
MIN_TOP1_AGREEMENT = 0.4
NUM_TOKENS = 128
BLOCK_SIZE = 16


@torch.no_grad()
def _unit_gain_(model: torch.nn.Module, seed: int = 0) -> None:
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.uniform_(0.5, 1.5, generator=generator)
        elif "embed" in name or "lm_head" in name:
            param.normal_(0.0, 1.0 if "embed" in name else param.shape[-1] ** -0.5, generator=generator)
        else:
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)


def _prefill_logits(model: torch.nn.Module, backend_name: str, device: torch.device) -> torch.Tensor:
    tokens = torch.randint(0, model.config.vocab_size, (NUM_TOKENS,), generator=torch.Generator().manual_seed(1))
    blocks = list(range(1, NUM_TOKENS // BLOCK_SIZE + 1))
    metadata, positions = build_attn_metadata([NUM_TOKENS], [NUM_TOKENS], [blocks], BLOCK_SIZE)
    on_device = {
        f.name: getattr(metadata, f.name).to(device)
        for f in dataclasses.fields(metadata)
        if isinstance(getattr(metadata, f.name), torch.Tensor) and not f.name.endswith("_cpu")
    }
    metadata = dataclasses.replace(metadata, **on_device)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    spec = layers[0].get_kv_cache_spec(BLOCK_SIZE, torch.bfloat16)
    backend = get_attention_backend(backend_name)
    builder = backend.get_builder_cls()(spec, AttentionLimits(layers[0].num_heads, 1, NUM_TOKENS), device)
    metadata = builder.build(metadata)
    shape = backend.get_kv_cache_shape(len(blocks) + 1, spec)
    kv_caches = {m.layer_name: torch.zeros(shape, dtype=torch.bfloat16, device=device) for m in layers}
    with torch.no_grad():
        hidden = model(tokens.to(device), positions.to(device), forward_context(metadata, kv_caches))
        return model.compute_logits(hidden)


def _compare(num_layers: int | None, device: torch.device, backend_name: str) -> tuple[float, float]:
    config = dummy_shape_config("llama-3.1-8b")
    if num_layers is not None:
        config.num_hidden_layers = num_layers
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = get_model_class(config)(config, get_attention_backend(backend_name)).eval()
    finally:
        torch.set_default_dtype(previous)
    _unit_gain_(model)
    reference = _prefill_logits(model, backend_name, device)
    method = Fp8Config().linear_method()
    for layer in model.modules():
        if isinstance(layer, LinearBase):
            layer.quant_method = method
            layer.process_weights_after_loading()
    logits = _prefill_logits(model, backend_name, device)
    rel = float((logits - reference).norm() / reference.norm())
    agreement = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
    print(
        f"FP8 Llama-3.1-8B shape ({config.num_hidden_layers} layers, {device.type}): logits relative L2 {rel:.4f}, "
        f"greedy top-1 agreement {agreement:.3f}"
    )
    return rel, agreement


@pytest.mark.slow
def test_fp8_llama_shape_cut_on_cpu():
    rel, agreement = _compare(4, torch.device("cpu"), "torch")
    assert rel < LOGIT_REL_TOL and agreement >= MIN_TOP1_AGREEMENT


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.serial  # a whole 8B model in bf16 and its FP8 copy: not beside other test processes
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_llama_3_1_8b_shape_on_gpu():
    rel, agreement = _compare(None, torch.device("cuda"), "triton")
    assert rel < LOGIT_REL_TOL and agreement >= MIN_TOP1_AGREEMENT
