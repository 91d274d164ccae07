"""Worker tests: the model runner's persistent `InputBatch` and its sampling rows, the CUDA-graph
batch keys, sleep mode over tagged memory (on the CPU here; CUDA virtual memory with `-m gpu`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pagoda.worker.input_batch import InputBatch


@pytest.fixture
def make_input_batch() -> Callable[[int, int, list[int], int], InputBatch]:
    """Builds empty `InputBatch`es on the CPU without pinned memory, as a CPU runner does:
    `make_input_batch(max_num_reqs, max_model_len, block_sizes, vocab_size)`, with one block
    size per KV-cache group."""

    def make(max_num_reqs: int, max_model_len: int, block_sizes: list[int], vocab_size: int) -> InputBatch:
        return InputBatch(max_num_reqs, max_model_len, block_sizes, vocab_size, torch.device("cpu"), pin_memory=False)

    return make
