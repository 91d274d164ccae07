"""`pagoda bench latency` and `bench throughput` with speculation: both engines in one run, the
acceptance the speculating one counted, and forced acceptance at its two exact ends (alpha 1:
every draft kept; alpha 0: none), which only the flags can have reached the engine with."""

from __future__ import annotations

import copy
import json
import math

import pytest
from model_utils import TINY_CONFIGS
from transformers import AutoModelForCausalLM

from pagoda.entrypoints.cli import main

K = 2
NGRAM = ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": K})]
# 7 output tokens: the prefill's, then two verify steps of k + 1 = 3 each at alpha 1.
LATENCY = ["--device", "cpu", "--batch-sizes", "1", "2", "--prompt-len", "8", "--output-len", "7"]
LATENCY += ["--prefill-lens", "8", "--repeats", "1", "--enforce-eager"]


@pytest.fixture(scope="module")
def tiny_qwen3_10k_vocab(tmp_path_factory) -> str:
    """Tiny Qwen3 whose vocabulary holds the throughput workload's token ids (100..9999)."""
    config = copy.deepcopy(TINY_CONFIGS["qwen3"])
    config.vocab_size = 10000
    path = str(tmp_path_factory.mktemp("tiny-qwen3-10k"))
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--forced-acceptance", "0.8"], "--forced-acceptance needs --speculative-config"),
        ([*NGRAM, "--forced-acceptance", "1.5"], "--forced-acceptance must be in [0, 1], got 1.5"),
        (
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "forced_acceptance": 1}'],
            "speculative_config.forced_acceptance is benchmark-only",
        ),
        (["--speculative-config", '{"method": "ngram"}'], "speculative_config needs num_speculative_tokens"),
    ],
)
@pytest.mark.parametrize("command", ["latency", "throughput"])
def test_bad_speculation_flags_are_clear_errors(command: str, flags: list[str], message: str, capsys) -> None:
    assert main(["bench", command, "--model", "no-such-model", *flags]) == 2
    assert message in capsys.readouterr().err


def test_bench_latency_at_forced_acceptance_1_keeps_every_draft(tiny_qwen3_10k_vocab, tmp_path, capsys) -> None:
    result_json = tmp_path / "latency.json"
    argv = ["bench", "latency", "--model", tiny_qwen3_10k_vocab, *LATENCY, *NGRAM, "--forced-acceptance", "1"]
    assert main([*argv, "--result-json", str(result_json)]) == 0
    out = capsys.readouterr().out
    assert "speculation (ngram, k = 2, forced acceptance 1): per-request decode, pagoda against pagoda-spec" in out
    rows = out.strip().splitlines()[-2:]
    assert [row.split()[0] for row in rows] == ["1", "2"]

    result = json.loads(result_json.read_text())
    assert all(set(f["ms"]) == {"pagoda", "pagoda-spec"} for f in result["figures"])
    assert result["speculation"]["config"]["forced_acceptance"] == 1.0
    for row, batch_size in zip(result["speculation"]["decode"], [1, 2], strict=True):
        assert row["batch_size"] == batch_size
        # Two verify steps per request in each of the two full runs (untimed and timed), all kept.
        assert row["num_verify_steps"] == 2 * 2 * batch_size
        assert row["acceptance_rate"] == 1.0 and row["per_position_acceptance"] == [1.0] * K
        assert row["mean_accepted_length"] == K + 1
        # Timings of a tiny model on a shared CPU are differences of noisy medians: their sign is
        # not the test's to assert (it failed under load), only that they were taken.
        assert all(math.isfinite(row[key]) for key in ("tok_per_s_off", "tok_per_s_on", "verify_step_ms"))
        assert row["speedup"] == pytest.approx(row["tok_per_s_on"] / row["tok_per_s_off"])


def test_bench_throughput_at_forced_acceptance_0_keeps_no_draft(tiny_qwen3_10k_vocab, tmp_path, capsys) -> None:
    result_json = tmp_path / "throughput.json"
    argv = ["bench", "throughput", "--model", tiny_qwen3_10k_vocab, "--device", "cpu", "--enforce-eager"]
    argv += ["--num-prompts", "3", "--min-prompt-len", "4", "--max-prompt-len", "12", "--output-len", "6"]
    assert main([*argv, *NGRAM, "--forced-acceptance", "0", "--result-json", str(result_json)]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.strip().splitlines()[-3:-1]] == ["pagoda", "pagoda-spec"]
    assert "speculation (ngram, k = 2, forced acceptance 0): pagoda-spec" in out

    result = json.loads(result_json.read_text())
    plain, speculative = result["measurements"]
    assert (plain["engine"], speculative["engine"]) == ("pagoda", "pagoda-spec")
    assert plain["output_tokens"] == speculative["output_tokens"] == 18
    assert plain["acceptance"] is None
    acceptance = speculative["acceptance"]
    # Each request's decode steps verified drafts (the proposer fills them), all but its last one
    # (max_tokens leaves that one no room for a draft), and kept none: one token each.
    assert acceptance["num_verify_steps"] == 3 * 4 and acceptance["num_draft_tokens"] > acceptance["num_verify_steps"]
    assert acceptance["num_accepted_tokens"] == 0 and acceptance["mean_accepted_length"] == 1.0
    assert result["speculation"]["speedup"] == pytest.approx(plain["seconds"] / speculative["seconds"])


def test_bench_latency_with_a_draft_model_at_forced_acceptance_1(tiny_qwen3_10k_vocab, tmp_path, capsys) -> None:
    """The draft model proposes k drafts after every step: all kept at alpha 1."""
    spec = {"method": "draft_model", "model": tiny_qwen3_10k_vocab, "num_speculative_tokens": K}
    result_json = tmp_path / "latency.json"
    argv = ["bench", "latency", "--model", tiny_qwen3_10k_vocab, *LATENCY, "--batch-sizes", "1"]
    argv += ["--speculative-config", json.dumps(spec), "--forced-acceptance", "1", "--result-json", str(result_json)]
    assert main(argv) == 0
    assert "speculation (draft_model, k = 2, forced acceptance 1)" in capsys.readouterr().out
    (row,) = json.loads(result_json.read_text())["speculation"]["decode"]
    assert row["num_verify_steps"] == 2 * 2 and row["acceptance_rate"] == 1.0
    # A difference of noisy medians (it came out negative under load): taken, its sign not asserted.
    assert math.isfinite(row["verify_step_ms"])
