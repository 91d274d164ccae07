"""The LoRA products over a batch of tokens with mixed adapters: shrink, then expand.

shrink: h[t] = x[t] A[slot(t)]^T for every token with an adapter (h in float32, [T, S * R]:
S output slices of R padded rank columns each); expand: y[t, slice i] += h[t, i R:(i + 1) R]
B[slot(t), slice i]^T. On CUDA they are Triton kernels over the persistent batch index (graph
safe; on the CPU too when the attention backend is Triton, interpreted); elsewhere the torch
reference below, which the kernels are tested against.
"""

from __future__ import annotations

import torch

from pagoda.lora.mapping import LoRABatchIndex


def shrink(x: torch.Tensor, lora_a: torch.Tensor, index: LoRABatchIndex, use_triton: bool) -> torch.Tensor:
    """x [T, in], lora_a [slots, S * R, in] -> h [T, S * R] float32 (zero for tokens without an adapter)."""
    out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    if use_triton:
        from pagoda.lora.triton_ops import lora_shrink

        lora_shrink(x, lora_a, out, index.sorted_tokens.gpu, index.tiles)
        return out
    token_slots = index.token_slots.gpu[: x.shape[0]]
    for slot in index.active_slots:
        rows = torch.nonzero(token_slots == slot).squeeze(1)
        out[rows] = (x[rows] @ lora_a[slot].T).float()
    return out


def expand(
    y: torch.Tensor,
    h: torch.Tensor,
    lora_b: torch.Tensor,
    slices: tuple[tuple[int, int], ...],
    index: LoRABatchIndex,
    use_triton: bool,
) -> None:
    """y [T, out] += per slice i (output offset, size): h[:, i R:(i + 1) R] lora_b[slot, offset:offset + size]^T."""
    rank = lora_b.shape[2]
    if use_triton:
        from pagoda.lora.triton_ops import lora_expand

        lora_expand(h, lora_b, y, tuple(offset for offset, _ in slices[1:]), index.sorted_tokens.gpu, index.tiles)
        return
    token_slots = index.token_slots.gpu[: y.shape[0]]
    for slot in index.active_slots:
        rows = torch.nonzero(token_slots == slot).squeeze(1)
        delta = torch.empty(len(rows), y.shape[1], dtype=y.dtype, device=y.device)
        for i, (offset, size) in enumerate(slices):
            part = h[rows, i * rank : (i + 1) * rank].to(y.dtype)
            delta[:, offset : offset + size] = part @ lora_b[slot, offset : offset + size].T
        y[rows] += delta  # rows are distinct tokens
