"""`--kv-offload-gib`, `--kv-offload-save-on-finish` and `--kv-offload-prompts-first` reach the
engine settings of every command."""

from __future__ import annotations

from pagoda.entrypoints.cli import build_parser, engine_kwargs


def test_offload_flags_become_engine_settings() -> None:
    parser = build_parser()
    args = ["serve", "--kv-offload-gib", "2.5", "--kv-offload-save-on-finish", "--kv-offload-prompts-first"]
    kwargs = engine_kwargs(parser.parse_args(args))
    assert (kwargs["kv_offload_gib"], kwargs["kv_offload_save_on_finish"], kwargs["kv_offload_prompts_first"]) == (
        2.5,
        True,
        True,
    )
    plain = engine_kwargs(parser.parse_args(["generate", "hi"]))
    assert not {"kv_offload_gib", "kv_offload_save_on_finish", "kv_offload_prompts_first"} & set(plain)
