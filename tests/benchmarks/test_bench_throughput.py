"""`pagoda bench throughput` runs its workload end to end and reports every output token; its HF
peers (one padded `generate` batch, and continuous batching) run the same requests."""

from __future__ import annotations

import json

import pytest
import torch
from model_utils import TINY_CONFIGS
from transformers import AutoModelForCausalLM

from pagoda.benchmarks.roofline import (
    ByteWidths,
    decode_step_work,
    model_shape,
    shared_prefix_floor_seconds,
    weight_bytes_per_step,
    workload_floor_seconds,
)
from pagoda.benchmarks.throughput import Workload, nanobench_workload, run_hf, shared_prefix_workload
from pagoda.config import ConfigError
from pagoda.entrypoints.cli import main
from pagoda.model.loader.dummy import dummy_shape_config

# A dummy model of a real shape: the workload's token ids (100..9999) fit its vocabulary.
SMALL = ["--model", "smollm2-135m", "--load-format", "dummy", "--device", "cpu"]
SMALL += ["--num-prompts", "3", "--min-prompt-len", "4", "--max-prompt-len", "20", "--output-len", "5"]

BF16 = ByteWidths.uniform(2)


def test_bench_throughput_prints_the_table(capsys) -> None:
    assert main(["bench", "throughput", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "3 prompts" in out and "15 output tokens" in out
    assert out.strip().splitlines()[-1].split()[:4] == ["pagoda", "all", "of", "3"]
    assert "floor: bytes over the copy bandwidth" in out


def test_bench_throughput_runs_the_hf_peer_on_a_labelled_subset(tmp_path, capsys) -> None:
    result_json = tmp_path / "throughput.json"
    argv = ["bench", "throughput", *SMALL, "--peer", "hf", "--peer-num-prompts", "2"]
    assert main([*argv, "--result-json", str(result_json)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.strip().splitlines()[-3:]]
    assert rows[0][:5] == ["pagoda", "all", "of", "3", "15"]
    assert rows[1][:6] == ["pagoda", "first", "2", "of", "3", "10"]
    assert rows[2][:6] == ["hf-generate", "first", "2", "of", "3", "10"]
    measurements = json.loads(result_json.read_text())["measurements"]
    assert [(m["engine"], m["requests"], m["output_tokens"]) for m in measurements] == [
        ("pagoda", 3, 15),
        ("pagoda", 2, 10),
        ("hf-generate", 2, 10),
    ]
    assert all(m["seconds"] > 0 and m["output_tok_per_s"] > 0 for m in measurements)
    # Nothing runs faster than its floor; the subset's floor is the subset's own.
    assert all(0 < m["fraction_of_floor"] <= 1 for m in measurements)
    assert measurements[1]["floor_seconds"] == measurements[2]["floor_seconds"] < measurements[0]["floor_seconds"]


def test_bench_throughput_fixed_workload_reports_its_peak_running_count(tmp_path, capsys) -> None:
    """Every prompt --input-len long; the peak running count is bounded by --max-num-seqs."""
    result_json = tmp_path / "throughput.json"
    argv = ["bench", "throughput", *SMALL, "--workload", "fixed", "--input-len", "7", "--num-prompts", "5"]
    assert main([*argv, "--max-num-seqs", "2", "--result-json", str(result_json)]) == 0
    assert "5 prompts, 35 prompt tokens, 25 output tokens" in capsys.readouterr().out
    (measurement,) = json.loads(result_json.read_text())["measurements"]
    assert measurement["peak_running"] == 2


def test_bench_throughput_fixed_workload_needs_an_input_len(capsys) -> None:
    assert main(["bench", "throughput", *SMALL, "--workload", "fixed"]) == 2
    assert "--workload fixed needs --input-len >= 1" in capsys.readouterr().err


def test_bench_throughput_rejects_a_peer_subset_larger_than_the_workload(capsys) -> None:
    assert main(["bench", "throughput", *SMALL, "--peer", "hf", "--peer-num-prompts", "4"]) == 2
    assert "--peer-num-prompts must be in [1, 3]" in capsys.readouterr().err


def test_hf_continuous_batching_peer_gives_each_request_its_own_length() -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS["qwen3"], dtype=torch.float32).eval()
    # Sampled at temperature 0.6 like nanobench, so EOS-like tokens come up and must not stop anything.
    workload = Workload(prompts=[[1, 2, 3], [7] * 20, [9] * 11, [4] * 40], output_lens=[3, 17, 1, 9], temperature=0.6)
    engine, seconds = run_hf(model, workload)  # fails inside if a request's token count differs
    assert engine == "hf-cb" and seconds > 0


def test_nanobench_workload_is_the_published_one() -> None:
    workload = nanobench_workload()
    assert len(workload.prompts) == 256
    assert workload.num_output_tokens == 133_966
    assert all(100 <= len(p) <= 1024 for p in workload.prompts)
    assert workload.temperature == 0.6
    head = workload.head(32)
    assert head.prompts == workload.prompts[:32] and head.output_lens == workload.output_lens[:32]


def test_workload_floor_is_one_prefill_then_a_decode_step_per_later_token(h200) -> None:
    shape = model_shape(dummy_shape_config("qwen3-0.6b"))
    floor = workload_floor_seconds(shape, [10, 20], [3, 1], chunk_size=8192, widths=BF16, rates=h200)
    # Both prompts in one prefill step (30 tokens); then request 0 alone decodes its 2nd and 3rd tokens.
    prefill_bytes = weight_bytes_per_step(shape, 0, BF16) + 30 * 1024 * 2
    prefill_flops = 2 * shape.body_params * 30 + 2 * 2 * shape.lm_head_params + 4 * 28 * 16 * 128 * (55 + 210)
    steps = [decode_step_work(shape, [11], BF16), decode_step_work(shape, [12], BF16)]
    expected = max(prefill_bytes / 4.27e12, prefill_flops / 789e12) + sum(map(h200.floor_seconds, steps))
    assert floor == pytest.approx(expected, rel=1e-12)


def test_nanobench_floor_of_the_qwen3_shape_is_about_3_5_s_on_an_h200(h200) -> None:
    workload = nanobench_workload()
    shape = model_shape(dummy_shape_config("qwen3-0.6b"))
    floor = workload_floor_seconds(shape, [len(p) for p in workload.prompts], workload.output_lens, 8192, BF16, h200)
    # The estimate is about 3.5 s; the KV cache read by 133k decode tokens is most of it.
    assert 3.4 < floor < 3.9


def test_shared_prefix_workload_takes_its_prefixes_round_robin() -> None:
    workload = shared_prefix_workload(7, num_prefixes=3, prefix_len=16, suffix_len=5, output_len=4, seed=0)
    assert workload.prefix_ids == [0, 1, 2, 0, 1, 2, 0]
    assert all(len(p) == 21 for p in workload.prompts)
    assert workload.prompts[0][:16] == workload.prompts[3][:16] == workload.prompts[6][:16]
    assert len({tuple(p[:16]) for p in workload.prompts}) == 3
    assert len({tuple(p[16:]) for p in workload.prompts}) == 7
    assert workload.head(2).prefix_ids == [0, 1] and workload.head(2).shared_prefix_len == 16
    with pytest.raises(ConfigError, match="--num-prefixes must be >= 1"):
        shared_prefix_workload(4, num_prefixes=0, prefix_len=16, suffix_len=5, output_len=4, seed=0)


def test_shared_prefix_floor_reads_each_prefix_once_per_step(h200) -> None:
    shape = model_shape(dummy_shape_config("qwen3-0.6b"))
    # The workload: 256 requests = one 2,048-token prefix + 64 own tokens, 128 tokens each.
    floor = shared_prefix_floor_seconds(shape, 2048, 1, [64] * 256, [128] * 256, 8192, BF16, h200)
    plain = workload_floor_seconds(shape, [2112] * 256, [128] * 256, 8192, BF16, h200)
    assert 0.15 < floor < 0.25 < 2.5 < plain  # the issue: about 0.19 s with the prefix read once
    # A step of one prefix over two requests reads what one request of prefix + own tokens and
    # the other's own tokens read.
    step = shared_prefix_floor_seconds(shape, 100, 1, [5, 7], [2, 2], 8192, BF16, h200) - shared_prefix_floor_seconds(
        shape, 100, 1, [5, 7], [1, 1], 8192, BF16, h200
    )
    own = decode_step_work(shape, [6, 8], BF16)
    expected = own.bytes_read + 100 * shape.kv_values_per_token * 2
    assert step == pytest.approx(expected / 4.27e12, rel=1e-12)
