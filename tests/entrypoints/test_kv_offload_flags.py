"""`--kv-offload-gib` and `--kv-offload-save-on-finish` reach the engine settings of every command."""

from __future__ import annotations

from pagoda.entrypoints.cli import build_parser, engine_kwargs


def test_offload_flags_become_engine_settings() -> None:
    parser = build_parser()
    kwargs = engine_kwargs(parser.parse_args(["serve", "--kv-offload-gib", "2.5", "--kv-offload-save-on-finish"]))
    assert (kwargs["kv_offload_gib"], kwargs["kv_offload_save_on_finish"]) == (2.5, True)
    plain = engine_kwargs(parser.parse_args(["generate", "hi"]))
    assert "kv_offload_gib" not in plain and "kv_offload_save_on_finish" not in plain
