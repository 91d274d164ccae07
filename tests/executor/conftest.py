"""Executor tests: tensor and pipeline parallelism through the multiprocess executor (gloo on the
CPU here; NCCL on several GPUs with `-m gpu`) and over Ray actors: every split must match a single
rank token for token, and a rank that dies must fail the engine within seconds, leaving nothing
behind."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from pagoda import LLM


@pytest.fixture
def start_llm() -> Iterator[Callable[..., LLM]]:
    """Builds `LLM(*args, **kwargs)` (here: with worker processes or Ray actors) and shuts every
    one down when the test ends, passed or failed, so that no rank outlives its test. Shutting
    down is idempotent: a test that checks what shutdown leaves behind calls `llm.shutdown()`
    itself."""
    llms: list[LLM] = []

    def start(*args, **kwargs) -> LLM:
        llm = LLM(*args, **kwargs)
        llms.append(llm)
        return llm

    yield start
    for llm in llms:
        llm.shutdown()
