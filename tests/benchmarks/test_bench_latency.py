"""`pagoda bench latency`: the floor formulas against hand counts, and the benchmark end to end
on a tiny checkpoint, with the HF static-cache peer, through the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from model_utils import TINY_CONFIGS, save_tiny_checkpoint
from transformers import AutoModelForCausalLM

from pagoda.benchmarks.roofline import (
    ByteWidths,
    DeviceRates,
    Work,
    decode_step_work,
    kv_bytes,
    measure_device_rates,
    model_shape,
    prefill_work,
    weight_bytes_per_step,
)
from pagoda.entrypoints.cli import main
from pagoda.model.loader.dummy import dummy_shape_config

BF16 = ByteWidths.uniform(2)


def test_llama_3_1_8b_reads_15_gb_per_decode_step(h200) -> None:
    shape = model_shape(dummy_shape_config("llama-3.1-8b"))
    hidden, inter, kv_dim = 4096, 14336, 8 * 128
    layer = 2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * inter + 2 * hidden
    assert shape.body_params == 32 * layer + hidden
    assert shape.lm_head_params == 128256 * hidden
    weights = weight_bytes_per_step(shape, 1, widths=BF16)
    assert weights == pytest.approx(15.0e9, rel=0.001)
    # The figure: 3.52 ms at 4.27 TB/s, for an empty context.
    assert 1000 * h200.floor_seconds(decode_step_work(shape, [0], BF16)) == pytest.approx(3.52, abs=0.005)


def test_fp8_weights_and_kv_cache_read_one_byte_per_value(h200) -> None:
    shape = model_shape(dummy_shape_config("llama-3.1-8b"))
    fp8 = ByteWidths.of(torch.bfloat16, "fp8", "fp8")
    assert fp8 == ByteWidths(body=1, activation=2, kv=1)
    assert ByteWidths.of(torch.bfloat16, None, "auto") == BF16
    # The body's 6.98B parameters at one byte, the LM head's 0.53B in bf16: 8.03 GB, 1.88 ms at 4.27 TB/s.
    assert weight_bytes_per_step(shape, 1, fp8) == shape.body_params + (shape.lm_head_params + 4096) * 2
    assert 1000 * h200.floor_seconds(decode_step_work(shape, [0], fp8)) == pytest.approx(1.88, abs=0.005)
    assert kv_bytes(shape, 10, fp8) * 2 == kv_bytes(shape, 10, BF16)


def test_qwen3_0_6b_tied_lm_head_is_read_as_the_lm_head(h200) -> None:
    shape = model_shape(dummy_shape_config("qwen3-0.6b"))
    assert shape.lm_head_params == 151936 * 1024
    # 596,049,920 parameters in all; the tied embedding is read once, as the LM head.
    assert shape.body_params + shape.lm_head_params == 596_049_920
    assert weight_bytes_per_step(shape, 1, BF16) == (596_049_920 + 1024) * 2  # 1.19 GB
    assert 1000 * h200.floor_seconds(decode_step_work(shape, [0], BF16)) == pytest.approx(0.279, abs=0.001)
    # 28 layers x 8 KV heads x 128 x (K and V) x 2 bytes = 114,688 bytes per cached token.
    assert kv_bytes(shape, 1, BF16) == 114_688


def test_decode_step_adds_kv_reads_and_attention_flops() -> None:
    shape = model_shape(dummy_shape_config("qwen3-0.6b"))
    empty, full = decode_step_work(shape, [0, 0], BF16), decode_step_work(shape, [100, 300], BF16)
    assert full.bytes_read - empty.bytes_read == kv_bytes(shape, 400, BF16)
    assert full.flops - empty.flops == 4 * 28 * 16 * 128 * 400
    assert empty.flops == 2 * 596_049_920 * 2


def test_prefill_reads_weights_once_per_chunk_and_computes_causal_attention(h200) -> None:
    shape = model_shape(dummy_shape_config("llama-3.1-8b"))
    one = prefill_work(shape, 8192, chunk_size=8192, widths=BF16)
    two = prefill_work(shape, 8192, chunk_size=4096, widths=BF16)
    weights = weight_bytes_per_step(shape, 0, BF16)
    assert one.bytes_read == weights + 8192 * 4096 * 2
    # The second chunk reads the weights again and the first chunk's cached K/V.
    assert two.bytes_read - one.bytes_read == weights + kv_bytes(shape, 4096, BF16)
    assert (
        one.flops
        == two.flops
        == (2 * shape.body_params * 8192 + 2 * shape.lm_head_params + 4 * 32 * 32 * 128 * 8192 * 8193 // 2)
    )
    # An 8k prefill of an 8B model is compute-bound on an H200: about 0.16 s.
    assert h200.floor_seconds(one) == one.flops / h200.matmul_flops_per_s
    assert h200.floor_seconds(one) == pytest.approx(0.16, abs=0.01)


def test_floor_is_the_slower_of_bytes_and_flops() -> None:
    rates = DeviceRates(copy_bytes_per_s=100.0, matmul_flops_per_s=1000.0)
    assert rates.floor_seconds(Work(bytes_read=200, flops=1000)) == 2.0
    assert rates.floor_seconds(Work(bytes_read=100, flops=3000)) == 3.0


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_model_shape_counts_every_parameter(name: str) -> None:
    config = TINY_CONFIGS[name]
    shape = model_shape(config)
    model = AutoModelForCausalLM.from_config(config)
    unique = {id(p): p.numel() for p in model.parameters()}
    embedding = config.vocab_size * config.hidden_size
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert shape.body_params + shape.lm_head_params + (0 if tied else embedding) == sum(unique.values())


def test_measured_rates_are_positive_on_cpu() -> None:
    rates = measure_device_rates(torch.device("cpu"), torch.float32)
    assert rates.copy_bytes_per_s > 1e8 and rates.matmul_flops_per_s > 1e8


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-qwen3"))
    save_tiny_checkpoint("qwen3", path)
    return path


FAST = ["--device", "cpu", "--batch-sizes", "1", "3", "--prompt-len", "8", "--output-len", "6", "--repeats", "1"]


def test_bench_latency_prints_the_table_and_json_with_the_hf_peer(tiny_qwen3, tmp_path, capsys) -> None:
    result_json = tmp_path / "latency.json"
    argv = ["bench", "latency", "--model", tiny_qwen3, *FAST, "--prefill-lens", "32", "96"]
    assert main([*argv, "--peer", "hf", "--result-json", str(result_json)]) == 0
    out = capsys.readouterr().out
    assert "32 tokens in 1 chunk(s), 96 tokens in 1 chunk(s) (max_num_batched_tokens 96)" in out
    lines = out.strip().splitlines()
    header = lines.index(next(line for line in lines if line.startswith("figure")))
    assert lines[header].split() == [
        "figure",
        "floor",
        "ms",
        "pagoda",
        "ms",
        "x",
        "floor",
        "hf-static",
        "ms",
        "x",
        "floor",
    ]
    names = ["decode/token b=1", "decode/token b=3", "prefill 32", "prefill 96"]
    assert [line[:22].strip() for line in lines[header + 1 :]] == names

    result = json.loads(result_json.read_text())
    assert result["device"] == "cpu" and result["dtype"] == "torch.float32"
    assert result["prefill_chunks"] == {"32": 1, "96": 1}
    assert result["copy_bytes_per_s"] > 0 and result["matmul_flops_per_s"] > 0
    assert [f["name"] for f in result["figures"]] == names
    for figure in result["figures"]:
        assert figure["floor_ms"] > 0 and figure["work"]["bytes_read"] > 0
        assert set(figure["ms"]) == {"pagoda", "hf-static"}
        # A decode figure is a difference of two timings: on a busy 2-core machine it can dip below 0.
        positive = figure["name"].startswith("prefill")
        assert all(ms > 0 if positive else ms != 0 for ms in figure["ms"].values())
    # Batch 3 reads three embedding rows and three contexts where batch 1 reads one.
    b1, b3 = result["figures"][0]["work"], result["figures"][1]["work"]
    assert b3["bytes_read"] > b1["bytes_read"] and b3["flops"] > b1["flops"]


def test_bench_latency_chunks_a_prefill_longer_than_the_token_budget(tiny_qwen3, tmp_path) -> None:
    result_json = tmp_path / "latency.json"
    argv = ["bench", "latency", "--model", tiny_qwen3, *FAST, "--prefill-lens", "96", "--max-num-batched-tokens", "40"]
    assert main([*argv, "--result-json", str(result_json)]) == 0
    result = json.loads(result_json.read_text())
    assert result["prefill_chunks"] == {"96": 3}
    assert all(set(f["ms"]) == {"pagoda"} for f in result["figures"])


def test_bench_latency_rejects_a_prefill_longer_than_the_model(tiny_qwen3, capsys) -> None:
    assert main(["bench", "latency", "--model", tiny_qwen3, *FAST, "--prefill-lens", "500"]) == 2
    assert "--prefill-lens must be in [1, 127] (max_model_len - 1), got [500]" in capsys.readouterr().err


@pytest.mark.parametrize(
    "peer",
    [
        # Times the device and sizes a full-length KV pool: alone on the GPU (tests/gpu_workers.py).
        pytest.param([], marks=[pytest.mark.gpu, pytest.mark.serial], id="alone"),
        # HF static-cache generate beside it: a minute more, so with the full-size runs.
        pytest.param(["--peer", "hf"], marks=pytest.mark.slow, id="beside-hf"),
    ],
)
def test_bench_latency_on_the_gpu_never_beats_its_floor(tmp_path, peer: list[str]) -> None:
    """Qwen3-0.6B shape, bf16, CUDA graphs: no figure may come in under its floor (that would
    mean a byte or FLOP count too high, or a rate too low)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    result_json = tmp_path / "latency.json"
    argv = ["bench", "latency", "--model", "qwen3-0.6b", "--load-format", "dummy", "--device", "cuda"]
    argv += ["--output-len", "32", "--prefill-lens", "1024", "8192", "--repeats", "2", *peer]
    assert main([*argv, "--result-json", str(result_json)]) == 0
    result = json.loads(result_json.read_text())
    assert result["prefill_chunks"] == {"1024": 1, "8192": 1}
    assert result["copy_bytes_per_s"] > 1e12 and result["matmul_flops_per_s"] > 1e14
    assert {name for figure in result["figures"] for name in figure["ms"]} >= (
        {"pagoda", "hf-static"} if peer else {"pagoda"}
    )
    for figure in result["figures"]:
        assert all(ms >= figure["floor_ms"] for ms in figure["ms"].values()), figure
