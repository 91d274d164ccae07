"""Structured-output unit tests: the xgrammar backend, the compile cache, grammar states and the
compile manager, over the byte-level tokenizer of the tiny checkpoints (one token per byte, so a
text's tokens are its bytes)."""

from __future__ import annotations

import pytest
from structured_output.byte_tokenizer import byte_tokenizer

from pagoda.structured_output.backend import GrammarBackend

VOCAB = 256
EOS_ID = 0


@pytest.fixture(scope="session")
def backend() -> GrammarBackend:
    return GrammarBackend(byte_tokenizer(), VOCAB, [EOS_ID])
