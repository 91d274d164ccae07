"""Shared test fixtures.

Every `LLMEngine` a test builds (directly, through `LLM`, or over a core process) is checked
after the test: once no request of it is in flight, no request state may be left in any
layer and its KV pool must be whole (`LLMEngine.check_idle`). Engines also run that check
themselves each time they go idle (PAGODA_DEBUG_CHECK_IDLE, inherited by core processes and
servers the tests start), so a leak fails the step that caused it.
"""

from __future__ import annotations

import os
import weakref

import pytest
import torch

# Without CUDA, Triton kernels run in Triton's interpreter. The switch is read when a kernel is
# first decorated, so it must be set here, before any test module imports pagoda's kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine_utils import check_engine_idle

from pagoda.engine.llm_engine import DEBUG_CHECK_IDLE_ENV, LLMEngine

os.environ.setdefault(DEBUG_CHECK_IDLE_ENV, "1")

# Every LLMEngine built in this test session (weakly: a dropped engine is not kept alive).
ENGINES: weakref.WeakSet[LLMEngine] = weakref.WeakSet()
_engine_init = LLMEngine.__init__


def _registering_init(self: LLMEngine, *args, **kwargs) -> None:
    _engine_init(self, *args, **kwargs)
    ENGINES.add(self)


LLMEngine.__init__ = _registering_init


@pytest.fixture(autouse=True)
def _engines_end_idle():
    yield
    for engine in list(ENGINES):
        check_engine_idle(engine)


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)
