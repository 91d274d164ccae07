"""The worker's memory budget on a device another process shares: what others hold is not this
engine's to count, and a share the device cannot give is refused at start with the field named."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.worker.worker import GiB, Worker


def fake_worker(utilization: float) -> Worker:
    """A worker with only what the memory check reads."""
    worker = Worker.__new__(Worker)
    worker.cache_config = SimpleNamespace(gpu_memory_utilization=utilization)
    worker.local_rank = 0
    return worker


def fake_device(monkeypatch, free: int, total: int, reserved: int = 0, allocated: int = 0) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: allocated)


def test_what_others_hold_is_in_use_and_the_share_fits(monkeypatch) -> None:
    fake_device(monkeypatch, free=60 * GiB, total=100 * GiB)
    assert fake_worker(0.4)._check_free_memory() == 40 * GiB


def test_cached_torch_memory_counts_as_free(monkeypatch) -> None:
    """An earlier engine of this process left 30 GiB in torch's cache: it is this process's to reuse."""
    fake_device(monkeypatch, free=20 * GiB, total=100 * GiB, reserved=35 * GiB, allocated=5 * GiB)
    assert fake_worker(0.5)._check_free_memory() == 45 * GiB


def test_a_share_the_device_cannot_give_names_the_field(monkeypatch) -> None:
    fake_device(monkeypatch, free=30 * GiB, total=100 * GiB)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.4 asks for 40\.00 GiB .* only 30\.00 GiB"):
        fake_worker(0.4)._check_free_memory()


HOLDER = textwrap.dedent(
    """
    import sys, time, torch
    held = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    print("held", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.gpu
@pytest.mark.serial
def test_an_engine_beside_another_process_gets_its_share() -> None:
    """Another process holds 40% of the device; an engine at 0.4 still gets a KV cache of its
    own share (not 0 blocks, as when the other's memory counted as this engine's use) and runs."""
    _, total = torch.cuda.mem_get_info()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(int(total * 0.4))], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with LLM("qwen3-0.6b", load_format="dummy", gpu_memory_utilization=0.4, max_model_len=4096) as llm:
            config = llm.llm_engine.engine_core.scheduler.kv_cache_manager.kv_cache_config
            kv_tokens = config.num_blocks * config.block_sizes[0]
            assert kv_tokens > 100_000  # ~50 GiB at 112 KiB a token, minus the weights
            out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, ignore_eos=True))
            assert len(out[0].outputs[0].token_ids) == 4
        with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.7"):
            LLM("qwen3-0.6b", load_format="dummy", gpu_memory_utilization=0.7)
    finally:
        holder.kill()
        holder.wait()
