"""The grammar mask pass: only the listed rows are masked, exactly to their bitmask, last in the
chain; in place when it only masks and no logprobs are asked; the Triton kernel (under Triton's
interpreter without CUDA) masks as the torch path does."""

from __future__ import annotations

import pytest
import torch
from sampling_utils import make_metadata

from pagoda.sample import triton_bitmask
from pagoda.sample.logits_processing import LOGITS_PROCESSORS, GrammarMask, apply_token_bitmask, process_logits
from pagoda.sample.metadata import TokenBitmask, TokenEntries

VOCAB = 70  # not a multiple of 32: the last word is partly padding


def bitmask_of(allowed: list[set[int]]) -> torch.Tensor:
    words = torch.zeros((len(allowed), -(VOCAB // -32)), dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for token in tokens:
            words[row, token // 32] |= 1 << (token % 32)
    return words.to(torch.int32)  # bit 31 set wraps to a negative int32, as xgrammar writes it


def test_rows_keep_exactly_their_allowed_tokens(device: str) -> None:
    logits = torch.randn(3, VOCAB, device=device)
    allowed = [{0, 31, 32, 63, 69}, {5}]
    reference = logits.clone()
    mask = TokenBitmask(torch.tensor([2, 0], device=device), bitmask_of(allowed).to(device))
    apply_token_bitmask(logits, mask)
    for row, tokens in ((2, allowed[0]), (0, allowed[1])):
        finite = set(torch.nonzero(torch.isfinite(logits[row])).flatten().tolist())
        assert finite == tokens
        assert torch.equal(logits[row, sorted(tokens)], reference[row, sorted(tokens)])
    assert torch.equal(logits[1], reference[1])


def test_tokens_past_the_mask_s_words_are_refused(device: str) -> None:
    """Masks may stop short of the logits (the grammars' vocabulary is the tokenizer's, the
    model's pads past it): the ids past their words are refused, the rest as their bits say."""
    logits = torch.randn(2, VOCAB + 40, device=device)
    reference = logits.clone()
    allowed = {0, 33, 69}
    apply_token_bitmask(logits, TokenBitmask(torch.tensor([1], device=device), bitmask_of([allowed]).to(device)))
    assert set(torch.nonzero(torch.isfinite(logits[1])).flatten().tolist()) == allowed
    assert torch.equal(logits[0], reference[0])


def test_the_mask_is_the_last_pass_and_only_when_a_row_is_constrained(device: str) -> None:
    assert isinstance(LOGITS_PROCESSORS[-1], GrammarMask)
    metadata = make_metadata([1.0, 1.0], [0, 0], [0, 0], device=device)
    logits = torch.randn(2, VOCAB, device=device)
    assert process_logits(logits, metadata) is logits
    metadata.grammar_bitmask = TokenBitmask(torch.tensor([1], device=device), bitmask_of([{3, 4}]).to(device))
    reference = logits.clone()
    processed = process_logits(logits, metadata)
    assert torch.isfinite(processed[1]).sum() == 2 and torch.isfinite(processed[0]).all()
    # Masks alone and no logprobs: in place, in the logits' dtype (nothing reads the raw values).
    assert processed is logits
    logits.copy_(reference)
    metadata.max_num_logprobs = 1  # raw logprobs read the logits: a float32 copy is masked instead
    processed = process_logits(logits, metadata)
    assert processed is not logits and torch.equal(logits, reference) and torch.isfinite(processed[1]).sum() == 2


def mask_case(dtype: torch.dtype) -> tuple[torch.Tensor, TokenBitmask, list[set[int]]]:
    """Rows 3 and 0 of five masked by words rows 2 and 0 (word_rows), over 4500 tokens (two
    kernel blocks, the last partial)."""
    vocab = 4500
    generator = torch.Generator().manual_seed(0)
    allowed = [set(torch.randint(0, vocab, (40,), generator=generator).tolist()) | {vocab - 1} for _ in range(3)]
    words = torch.zeros((3, -(vocab // -32)), dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for token in tokens:
            words[row, token // 32] |= 1 << (token % 32)
    logits = torch.randn(5, vocab, generator=generator).to(dtype)
    mask = TokenBitmask(torch.tensor([3, 0]), words.to(torch.int32), word_rows=torch.tensor([2, 0]))
    return logits, mask, [allowed[2], allowed[0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_word_rows_pick_each_entry_s_mask(dtype: torch.dtype) -> None:
    logits, mask, allowed = mask_case(dtype)
    reference = logits.clone()
    apply_token_bitmask(logits, mask)
    for row, tokens in zip((3, 0), allowed, strict=True):
        assert set(torch.nonzero(torch.isfinite(logits[row])).flatten().tolist()) == tokens
    assert torch.equal(logits[[1, 2, 4]], reference[[1, 2, 4]])


def test_the_triton_kernel_masks_as_the_torch_path() -> None:
    """On CUDA when there is one, else under Triton's interpreter on the CPU."""
    if not triton_bitmask.available():
        pytest.skip("triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for dtype in (torch.float32, torch.bfloat16):
        logits, mask, _ = mask_case(dtype)
        expected = logits.clone()
        apply_token_bitmask(expected, mask)  # the torch path, on the CPU
        rows, words, word_rows = (t.to(device) for t in (mask.rows, mask.words, mask.word_rows))
        masked = logits.to(device)
        triton_bitmask.apply_token_bitmask_triton(masked, rows, words, word_rows)
        assert torch.equal(masked.cpu(), expected)
        masked = logits.to(device)
        triton_bitmask.apply_token_bitmask_triton(masked, rows, words[[2, 0]], None)
        assert torch.equal(masked.cpu(), expected)
        # Words short of the logits (the first 100 of 141): the tokens past them are refused.
        short = TokenBitmask(mask.rows, mask.words[:, :100].contiguous(), mask.word_rows)
        expected = logits.clone()
        apply_token_bitmask(expected, short)
        assert torch.isinf(expected[[3, 0], 3200:]).all()
        masked = logits.to(device)
        triton_bitmask.apply_token_bitmask_triton(masked, rows, short.words.to(device), word_rows)
        assert torch.equal(masked.cpu(), expected)


def test_masks_alone_apply_in_place_in_the_logits_dtype(device: str) -> None:
    """bf16 logits under a ban, an allowed set and a grammar mask, no logprobs: masked in place,
    exactly as the float32 copy would be."""
    metadata = make_metadata([1.0, 1.0], [0, 0], [0, 0], device=device)
    metadata.banned_token_ids = TokenEntries(torch.tensor([0], device=device), torch.tensor([5], device=device))
    metadata.allowed_token_ids = TokenEntries(torch.tensor([1, 1], device=device), torch.tensor([3, 4], device=device))
    metadata.allowed_rows = torch.tensor([False, True], device=device)
    metadata.grammar_bitmask = TokenBitmask(torch.tensor([0], device=device), bitmask_of([{5, 6, 7}]).to(device))
    logits = torch.randn(2, VOCAB, device=device).to(torch.bfloat16)
    copy = logits.float()
    metadata.max_num_logprobs = 1
    expected = process_logits(copy, metadata)
    metadata.max_num_logprobs = None
    processed = process_logits(logits, metadata)
    assert processed is logits and processed.dtype == torch.bfloat16
    assert torch.equal(processed.float(), expected)
    assert set(torch.nonzero(torch.isfinite(processed[0])).flatten().tolist()) == {6, 7}
