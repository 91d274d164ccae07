"""The grammar mask pass: only the listed rows are masked, exactly to their bitmask, last in the chain."""

from __future__ import annotations

import torch
from sampling_utils import make_metadata

from pagoda.sample.logits_processing import LOGITS_PROCESSORS, GrammarMask, apply_token_bitmask, process_logits
from pagoda.sample.metadata import TokenBitmask

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


def test_the_mask_is_the_last_pass_and_only_when_a_row_is_constrained(device: str) -> None:
    assert isinstance(LOGITS_PROCESSORS[-1], GrammarMask)
    metadata = make_metadata([1.0, 1.0], [0, 0], [0, 0], device=device)
    logits = torch.randn(2, VOCAB, device=device)
    assert process_logits(logits, metadata) is logits
    metadata.grammar_bitmask = TokenBitmask(torch.tensor([1], device=device), bitmask_of([{3, 4}]).to(device))
    processed = process_logits(logits, metadata)
    assert processed is not logits and torch.isfinite(processed[1]).sum() == 2 and torch.isfinite(processed[0]).all()
