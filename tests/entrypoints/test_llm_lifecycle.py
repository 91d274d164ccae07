"""The offline `LLM`'s lifetime: its model and KV cache go as soon as the object does (`del`,
no `gc.collect()` needed though the model sits in reference cycles), or at the end of a `with`
block; `shutdown` may be called any number of times; with worker processes, `del` stops them.
On a GPU (marked `gpu`), `torch.cuda.memory_allocated()` returns to its baseline and a second
engine gets the first one's KV cache size. Tiny random llama3 checkpoints throughout."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from model_utils import save_tiny_checkpoint
from server_utils import is_running, wait_until

from pagoda import LLM, SamplingParams
from pagoda.engine.errors import EngineDeadError
from pagoda.worker.gpu_model_runner import GPUModelRunner

CPU = {"device": "cpu", "dtype": "float32", "max_model_len": 64}


@pytest.fixture(scope="module")
def tiny_llama3(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("llama3"))
    save_tiny_checkpoint("llama3", path)
    return path


def runner_of(llm: LLM) -> GPUModelRunner:
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    assert runner is not None
    return runner


def device_memory_refs(llm: LLM) -> list[weakref.ref]:
    """Weak references to a weight and a KV-cache tensor of `llm`, after one request ran."""
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    runner = runner_of(llm)
    return [weakref.ref(next(runner.model.parameters())), weakref.ref(next(iter(runner.kv_caches.values())))]


def test_del_frees_the_model_and_kv_cache(tiny_llama3: str) -> None:
    llm = LLM(tiny_llama3, **CPU)
    refs = device_memory_refs(llm)
    gc.disable()  # the collection must come from the LLM's end, not from the collector's schedule
    try:
        del llm
        assert all(ref() is None for ref in refs)
    finally:
        gc.enable()


def test_a_with_block_shuts_the_engine_down(tiny_llama3: str) -> None:
    with LLM(tiny_llama3, **CPU) as llm:
        refs = device_memory_refs(llm)
    assert all(ref() is None for ref in refs)
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.generate([[1, 2, 3]], use_tqdm=False)


def test_shutdown_is_idempotent(tiny_llama3: str) -> None:
    llm = LLM(tiny_llama3, **CPU)
    llm.shutdown()
    llm.shutdown()
    with llm:
        pass
    del llm  # and the finalizer, once more


def test_del_stops_the_worker_processes(tiny_llama3: str) -> None:
    llm = LLM(tiny_llama3, **CPU, tensor_parallel_size=2, distributed_executor_backend="mp")
    pids = [process.pid for process in llm.llm_engine.engine_core.executor.processes]
    assert all(is_running(pid) for pid in pids)
    del llm
    assert wait_until(lambda: not any(is_running(pid) for pid in pids), 60)


@pytest.mark.gpu
@pytest.mark.serial
def test_del_returns_the_gpu_memory_to_a_second_engine(tiny_llama3: str) -> None:
    cuda = {"device": "cuda", "max_model_len": 64, "gpu_memory_utilization": 0.3}
    baseline = torch.cuda.memory_allocated()
    llm = LLM(tiny_llama3, **cuda)
    refs = device_memory_refs(llm)
    first = runner_of(llm).kv_cache_config
    assert torch.cuda.memory_allocated() > baseline
    del llm
    assert all(ref() is None for ref in refs)
    # torch's cuBLAS workspaces (allocated at the first matmul, kept per stream) may remain.
    leftover = 256 * 2**20
    assert torch.cuda.memory_allocated() - baseline <= leftover
    second = LLM(tiny_llama3, **cuda)
    try:
        # The second pool is the first one less at most what may remain (not "0 tokens").
        page_bytes = sum(t.size_bytes for t in first.kv_cache_tensors) // first.num_blocks
        assert first.num_blocks - leftover // page_bytes <= runner_of(second).kv_cache_config.num_blocks
    finally:
        second.shutdown()


def test_startup_objects_leave_the_collectors_scans_until_shutdown(tiny_llama3: str) -> None:
    llm = LLM(tiny_llama3, **CPU)
    assert gc.get_freeze_count() > 0  # the model, the engine and what they hold are frozen
    llm.shutdown()
    assert gc.get_freeze_count() == 0  # handed back before the engine went
