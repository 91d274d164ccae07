"""The CPU options: `cpu_threads` (validation, its default from the process's affinity, how the
worker applies and splits it) and dtype "auto" on the CPU (bfloat16 exactly where the CPU
multiplies it natively; the CPU's features mocked both ways)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from pagoda import config as config_module
from pagoda import cpu_platform
from pagoda.config import ConfigError, DeviceConfig
from pagoda.cpu_platform import cpu_has_native_bf16  # the real one: tests/conftest.py stands in for it later
from pagoda.engine.arg_utils import _resolve_dtype
from pagoda.entrypoints.cli import build_parser, engine_kwargs
from pagoda.model.layers.quantization import gguf_kernels
from pagoda.worker.worker import Worker


def test_cpu_threads_default_is_the_affinity() -> None:
    assert cpu_platform.usable_cpu_count() == len(os.sched_getaffinity(0))
    assert DeviceConfig(device="cpu").cpu_threads == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("value", [0, -1, 5, True, 2.0, "2"])
def test_bad_cpu_threads_name_the_field_and_limit(monkeypatch, value) -> None:
    monkeypatch.setattr(config_module, "usable_cpu_count", lambda: 4)
    with pytest.raises(ConfigError, match=r"cpu_threads must be an integer in \[1, 4\] \(the CPUs this process"):
        DeviceConfig(device="cpu", cpu_threads=value)


def test_cpu_threads_within_the_affinity(monkeypatch) -> None:
    monkeypatch.setattr(config_module, "usable_cpu_count", lambda: 4)
    assert DeviceConfig(device="cpu").cpu_threads == 4
    assert DeviceConfig(device="cpu", cpu_threads=3).cpu_threads == 3


def test_cli_flag() -> None:
    args = build_parser().parse_args(["serve", "--cpu-threads", "1"])
    assert engine_kwargs(args)["cpu_threads"] == 1
    assert "cpu_threads" not in engine_kwargs(build_parser().parse_args(["serve"]))


def test_configure_cpu_threads_sets_torch_and_child_env(monkeypatch) -> None:
    for name in cpu_platform.THREAD_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    try:
        cpu_platform.configure_cpu_threads(1)
        assert torch.get_num_threads() == 1
        assert all(os.environ[name] == "1" for name in cpu_platform.THREAD_ENV_VARS)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("threads", "world_size", "backend", "expected"),
    [(4, 1, "uni", 4), (4, 2, "mp", 2), (3, 2, "mp", 1), (2, 4, "mp", 1), (4, 2, "ray", 4)],
)
def test_local_ranks_share_the_threads(threads: int, world_size: int, backend: str, expected: int) -> None:
    worker = SimpleNamespace(
        device_config=SimpleNamespace(cpu_threads=threads),
        parallel_config=SimpleNamespace(world_size=world_size, distributed_executor_backend=backend),
    )
    assert Worker._cpu_threads_per_rank(worker) == expected


@pytest.mark.parametrize(("native_bf16", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_on_the_cpu(monkeypatch, native_bf16: bool, expected: torch.dtype) -> None:
    monkeypatch.setattr(cpu_platform, "cpu_has_native_bf16", lambda: native_bf16)
    assert _resolve_dtype("auto", DeviceConfig(device="cpu")) == expected
    assert _resolve_dtype("float32", DeviceConfig(device="cpu")) == torch.float32  # explicit stays


@pytest.mark.parametrize("kernels", [True, False])
def test_a_gguf_model_stays_float32_where_its_block_kernels_run(monkeypatch, kernels: bool) -> None:
    """Its linears stay 4-bit blocks either way, read in float32 by the kernels: bfloat16 would buy
    nothing and take the slower int4 path; without the kernels the CPU's native bfloat16 decides."""
    monkeypatch.setattr(cpu_platform, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(gguf_kernels, "unavailable_reason", lambda: None if kernels else "no compiler")
    expected = torch.float32 if kernels else torch.bfloat16
    assert _resolve_dtype("auto", DeviceConfig(device="cpu"), "gguf") == expected
    assert _resolve_dtype("bfloat16", DeviceConfig(device="cpu"), "gguf") == torch.bfloat16


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "expected"), [(True, False, True), (False, True, True), (False, False, False)]
)
def test_native_bf16_detection(monkeypatch, avx512_bf16: bool, amx: bool, expected: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert cpu_has_native_bf16() == expected
