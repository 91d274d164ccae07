"""The grammar mask on CUDA: one Triton kernel that sets each refused logit to -inf in place.

The torch path unpacks every mask to a [R, V] temporary and copies the masked rows out and
back (about 1 GB of traffic at 256 rows of a 150k vocabulary, a quarter of a millisecond on an
H200); the kernel reads 4 bytes of mask per 32 tokens and writes only the logits it refuses.
Logits row `rows[i]` takes mask row `word_rows[i]` (i when None), in any float dtype; tokens past
the mask's words are refused (the masks cover the grammars' vocabulary, which may stop short of
the model's).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional off the GPU; the torch path runs everywhere
    triton = None

_BLOCK_SIZE = 4096


def available() -> bool:
    return triton is not None


def apply_token_bitmask_triton(
    logits: torch.Tensor, rows: torch.Tensor, words: torch.Tensor, word_rows: torch.Tensor | None
) -> None:
    num_rows = len(rows)
    if num_rows == 0:
        return
    vocab_size = logits.shape[-1]
    grid = (num_rows, triton.cdiv(vocab_size, _BLOCK_SIZE))
    _apply_token_bitmask_kernel[grid](
        logits,
        logits.stride(0),
        rows,
        rows if word_rows is None else word_rows,
        words,
        words.stride(0),
        words.shape[-1],
        vocab_size,
        HAS_WORD_ROWS=word_rows is not None,
        BLOCK_SIZE=_BLOCK_SIZE,
        num_warps=4,
    )


if triton is not None:

    @triton.jit
    def _apply_token_bitmask_kernel(
        logits_ptr,
        logits_stride,
        rows_ptr,
        word_rows_ptr,
        words_ptr,
        words_stride,
        num_words,
        vocab_size,
        HAS_WORD_ROWS: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        entry = tl.program_id(0)
        block = tl.program_id(1)
        row = tl.load(rows_ptr + entry).to(tl.int64)
        word_row = entry.to(tl.int64)
        if HAS_WORD_ROWS:
            word_row = tl.load(word_rows_ptr + entry).to(tl.int64)
        word_index = block * (BLOCK_SIZE // 32) + tl.arange(0, BLOCK_SIZE // 32)
        packed = tl.load(words_ptr + word_row * words_stride + word_index, mask=word_index < num_words, other=0)
        refused = ((packed[:, None] >> tl.arange(0, 32)[None, :]) & 1) == 0
        refused = tl.reshape(refused, (BLOCK_SIZE,))
        tokens = block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        tl.store(logits_ptr + row * logits_stride + tokens, -float("inf"), mask=refused & (tokens < vocab_size))
