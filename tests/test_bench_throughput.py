"""`pagoda bench throughput` runs its workload end to end and reports every output token."""

from __future__ import annotations

from pagoda.benchmarks.throughput import nanobench_workload
from pagoda.entrypoints.cli import main


def test_bench_throughput_prints_the_table(capsys) -> None:
    # A dummy model of a real shape: the workload's token ids (100..9999) fit its vocabulary.
    argv = ["bench", "throughput", "--model", "smollm2-135m", "--load-format", "dummy", "--device", "cpu"]
    argv += ["--num-prompts", "3", "--min-prompt-len", "4", "--max-prompt-len", "20", "--output-len", "5"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "3 prompts" in out and "15 output tokens" in out
    assert out.strip().splitlines()[-1].split()[0] == "pagoda"


def test_nanobench_workload_is_the_published_one() -> None:
    workload = nanobench_workload()
    assert len(workload.prompts) == 256
    assert workload.num_output_tokens == 133_966
    assert all(100 <= len(p) <= 1024 for p in workload.prompts)
    assert workload.temperature == 0.6
