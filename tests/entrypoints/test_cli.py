"""`pagoda` command-line parsing and the checks that fail before any model loads (exit 2, one line)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from pagoda import __version__
from pagoda.entrypoints.cli import CLI_SAMPLING_DEFAULTS, build_parser, engine_kwargs, main, sampling_params


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"pagoda {__version__}"


def test_the_cli_needs_no_server_package() -> None:
    """`pagoda generate` and `pagoda bench` run where fastapi is not installed (the server's
    extra): importing the CLI must import neither it nor uvicorn."""
    code = "import sys, pagoda.entrypoints.cli; print(sorted({'fastapi', 'uvicorn'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_log_level_before_or_after_the_command() -> None:
    parser = build_parser()
    assert parser.parse_args(["generate", "hi"]).log_level == "INFO"
    assert parser.parse_args(["--log-level", "debug", "generate", "hi"]).log_level == "debug"
    assert parser.parse_args(["generate", "hi", "--log-level", "error"]).log_level == "error"


def test_batch_invariant_flag_reaches_the_engine_and_the_benchmarks() -> None:
    parser = build_parser()
    assert engine_kwargs(parser.parse_args(["serve", "--batch-invariant"]))["batch_invariant"] is True
    assert engine_kwargs(parser.parse_args(["generate", "hi"]))["batch_invariant"] is False
    for kind in ("latency", "throughput"):
        assert parser.parse_args(["bench", kind, "--batch-invariant"]).batch_invariant


def test_gguf_weights_flag_reaches_the_engine_only_when_given() -> None:
    parser = build_parser()
    assert engine_kwargs(parser.parse_args(["serve", "--gguf-weights", "dequantized"]))["gguf_weights"] == "dequantized"
    assert "gguf_weights" not in engine_kwargs(parser.parse_args(["generate", "hi"]))


def test_sampling_flags_over_model_defaults_over_cli_defaults() -> None:
    args = build_parser().parse_args(["generate", "hi", "--top-k", "5", "--stop", "a", "--stop", "b"])
    params = sampling_params(args, {"temperature": 0.6, "top_k": 20})
    assert (params.temperature, params.top_k, params.stop) == (0.6, 5, ["a", "b"])
    assert params.repetition_penalty == CLI_SAMPLING_DEFAULTS["repetition_penalty"]
    assert sampling_params(args).temperature == CLI_SAMPLING_DEFAULTS["temperature"]


def test_serve_help_shows_groups_and_defaults(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for text in ("server:", "limits:", "features:", "model:", "(default: 8000)", "(default: 4096)", "MODEL"):
        assert text in out


def _error_of(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("pagoda: error: "), err
    return err


def test_serve_refuses_a_port_out_of_range(capsys) -> None:
    assert "port must be in [1, 65535], got 99999" in _error_of(["serve", "--port", "99999"], capsys)


def test_serve_refuses_a_busy_port(capsys) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert "cannot listen on 127.0.0.1" in _error_of(["serve", "--port", str(port)], capsys)


def test_serve_takes_the_model_once(capsys) -> None:
    assert "model given twice" in _error_of(["serve", "a.gguf", "--model", "b.gguf", "--port", "1"], capsys)


def test_serve_positional_hub_id_says_nothing_is_downloaded(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    err = _error_of(["serve", "HuggingFaceTB/SmolLM2-135M-Instruct", "--port", str(port)], capsys)
    assert "pagoda does not download models" in err and "huggingface-cli download" in err


def test_a_missing_tokenizer_fails_before_loading(capsys) -> None:
    assert "tokenizer must be" in _error_of(["generate", "hi", "--tokenizer", "/no/such/tokenizer"], capsys)
