"""FP8 experts for a mixture-of-experts layer, quantized at load (`quantization="fp8"`).

Each expert's stacked weights load in the model dtype, as the unquantized experts do, then
become float8 e4m3 with a float32 scale per expert and output row: `w13_scale` [E, 2I/tp],
`w2_scale` [E, H]. Tensor parallelism slices the weights before quantizing, so every rank's
scales are those of its own rows. The Triton kernel reads the FP8 tiles and multiplies its
accumulators by the scales (weight-only: the activations stay in the model dtype, which is
what bounds a decode step: the expert bytes read); elsewhere the dequantized weights run the
torch reference.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.model import ops
from pagoda.model.layers.fused_moe import FusedMoE, UnquantizedFusedMoEMethod, experts_reference
from pagoda.model.layers.quantization.fp8_ops import quantize_per_channel

if ops.TRITON_AVAILABLE:
    from pagoda.model.ops.triton_fused_moe import fused_experts


def quantize_experts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, rows, K] -> (float8 [E, rows, K], float32 scales [E, rows]), each row of each expert
    scaled to FP8's range."""
    quantized, scale = quantize_per_channel(weight.flatten(0, 1))
    return quantized.view(weight.shape), scale.view(weight.shape[:2])


class Fp8FusedMoEMethod(UnquantizedFusedMoEMethod):
    """Loads like the unquantized experts; `process_weights_after_loading` quantizes them."""

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        for name in ("w13", "w2"):
            weight, scale = quantize_experts(getattr(layer, f"{name}_weight").data)
            setattr(layer, f"{name}_weight", nn.Parameter(weight, requires_grad=False))
            setattr(layer, f"{name}_scale", nn.Parameter(scale, requires_grad=False))

    def apply(
        self, layer: FusedMoE, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        w13, w2 = layer.w13_weight, layer.w2_weight
        if ops.use_triton(hidden_states):
            return fused_experts(
                hidden_states, w13, w2, topk_weights, topk_ids, w13_scale=layer.w13_scale, w2_scale=layer.w2_scale
            )
        dtype = hidden_states.dtype
        w13 = (w13.float() * layer.w13_scale[:, :, None]).to(dtype)
        w2 = (w2.float() * layer.w2_scale[:, :, None]).to(dtype)
        return experts_reference(hidden_states, w13, w2, topk_weights, topk_ids)
