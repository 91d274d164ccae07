"""benchmarks/lora.py end to end on the CPU at a tiny shape: its random adapters load and the
three figures come out (the GPU run at the Llama-3.1-8B shape is the lead's: RESULTS.md)."""

from __future__ import annotations

import importlib.util
import os

from model_utils import save_tiny_checkpoint

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "lora.py")


def test_lora_benchmark_runs_tiny(tmp_path, capsys) -> None:
    spec = importlib.util.spec_from_file_location("lora_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    save_tiny_checkpoint("llama3", str(tmp_path))
    engine = ["--model", str(tmp_path), "--load-format", "auto", "--device", "cpu", "--dtype", "float32"]
    workload = ["--num-prompts", "8", "--input-len", "8", "--output-len", "4", "--num-adapters", "2"]
    bench.main([*engine, *workload, "--rank", "16", "--max-model-len", "64", "--max-num-seqs", "8"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[:3]] == ["base", "lora-none", "lora-mixed"]
    assert all(float(line.split()[3]) > 0 for line in lines[:3])
    assert "lower output tok/s (2 adapters of rank 16)" in lines[3]
