"""GGUF's 4-bit linear weights (Q4_0, Q4_1) kept 4-bit: their blocks rewritten as the plain
int4 groups `Int4LinearMethod` loads, so that a CPU model holds ~0.6 bytes per weight instead
of 2 (bf16) or 4 (float32); and those types and Q8_0 dequantized in torch, the values
`gguf.quants.dequantize` gives bit for bit, several times faster (its numpy pass over row
groups took 1.5 of SmolLM2's 5 s load on a 2-core CPU).

Both types are blocks of 32 weights along a row (the input dimension): an fp16 scale `d`, for
Q4_1 an fp16 minimum `m`, and 16 bytes of nibbles q in 0..15, value j in the low nibble of byte
j and value j + 16 in its high nibble. Q4_0 is w = d (q - 8), Q4_1 w = d q + m. Torch's int4
kernels read w = (q - 8) scale + zero per group, so scale = d and zero = 0 (Q4_0) or m + 8 d
(Q4_1), exact in float32. No `gguf` import: the block layout is read with numpy.
"""

from __future__ import annotations

import numpy as np
import torch

from pagoda.model.layers.quantization.gguf_kernels import Q4_0, Q4_1, Q8_0
from pagoda.model.layers.quantization.int4 import GROUP_SIZE

# Whether a 4-bit type's block has `m`.
HAS_MIN = {Q4_0: False, Q4_1: True}
DEQUANTIZED_IN_TORCH = (Q4_0, Q4_1, Q8_0)

# GGUF block tensors that are linear layers' weights (the rest are norms).
LINEAR_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def int4_groups(blocks: np.ndarray, ggml_type: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0/Q4_1 bytes, one row per output row [N, K / 32 * block bytes] ->
    (qweight uint8 [N, K / 2], column 2i in the low nibble and 2i + 1 in the high one;
    scale and zero float32 [N, K / 32]), with w = (q - 8) scale + zero."""
    has_min = HAS_MIN[ggml_type]
    header = 4 if has_min else 2
    rows = blocks.shape[0]
    blocks = blocks.reshape(rows, -1, header + GROUP_SIZE // 2)
    scale = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    if has_min:
        zero = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32) + 8 * scale
    else:
        zero = np.zeros_like(scale)
    nibbles = blocks[..., header:]
    # Weight j of a block: the low nibble of byte j (j < 16), else the high nibble of byte j - 16.
    values = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, -1)
    qweight = values[:, 0::2] | (values[:, 1::2] << 4)
    return torch.from_numpy(qweight), torch.from_numpy(scale), torch.from_numpy(zero)


def dequantize(blocks: np.ndarray, ggml_type: int) -> torch.Tensor:
    """Q4_0, Q4_1 or Q8_0 bytes, each innermost row a run of blocks ([..., K / 32 * block
    bytes]) -> float32 [..., K], the same values and float32 operations as
    `gguf.quants.dequantize`: d (q - 8), d q + m, d q."""
    header = 4 if ggml_type == Q4_1 else 2  # d, and Q4_1's m
    body = GROUP_SIZE if ggml_type == Q8_0 else GROUP_SIZE // 2
    data = torch.from_numpy(np.array(blocks)).view(-1, header + body)  # a copy: the file's map is read-only
    scale = data[:, :2].contiguous().view(torch.float16).float()
    quants = data[:, header:]
    if ggml_type == Q8_0:
        values = quants.contiguous().view(torch.int8).float()
    else:
        # Weight j of a block: the low nibble of byte j (j < 16), else the high nibble of byte j - 16.
        values = torch.cat((quants & 0x0F, quants >> 4), dim=-1)
        values = (values.to(torch.int8) - 8).float() if ggml_type == Q4_0 else values.float()
    weight = scale * values
    if ggml_type == Q4_1:
        weight += data[:, 2:4].contiguous().view(torch.float16).float()
    return weight.view(*blocks.shape[:-1], -1)
