"""Speculative settings: bad ones are refused naming the field and the limit."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest
from model_utils import TINY_CONFIGS, save_random_checkpoint, save_tiny_checkpoint

from pagoda.config import ConfigError, SpeculativeConfig
from pagoda.engine.arg_utils import create_engine_config
from pagoda.metrics import ServerMetrics
from pagoda.outputs import SchedulerStats
from pagoda.spec_decode.stats import SpecDecodingStats

BAD = [
    ({"method": "medusa", "num_speculative_tokens": 3}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer in \[1, 16\]"),
    ({"method": "ngram", "num_speculative_tokens": 17}, r"num_speculative_tokens must be an integer in \[1, 16\]"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    (
        {"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1},
        r"unknown speculative_config keys \['lookahead'\]",
    ),
    (
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
        "prompt_lookup_max",
    ),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "ngram takes none"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model is required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "forced_acceptance": 0.8}, "benchmark-only"),
    ("{not json", "must be a JSON object"),
]


@pytest.mark.parametrize("value,message", BAD)
def test_bad_settings_name_the_field(value, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.from_value(value)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("llama3"))
    save_tiny_checkpoint("llama3", path)
    return path


def test_the_engine_refuses_what_does_not_fit(tiny: str) -> None:
    config = create_engine_config(
        model=tiny, device="cpu", speculative_config='{"method": "ngram", "num_speculative_tokens": 4}'
    )
    assert config.speculative_config == SpeculativeConfig("ngram", 4)
    with pytest.raises(ConfigError, match="max_num_batched_tokens - 1 = 3"):
        create_engine_config(
            model=tiny,
            device="cpu",
            max_num_batched_tokens=4,
            max_num_seqs=4,
            speculative_config={"method": "ngram", "num_speculative_tokens": 4},
        )


def test_metrics_report_acceptance() -> None:
    stats = SpecDecodingStats()
    stats.observe(3, 2)
    stats.observe(2, 0)
    metrics = ServerMetrics()
    metrics.observe_scheduler(SchedulerStats(1, 0, 0.1, 0, 0, 0, spec_decoding=stats))
    text = metrics.render().decode()
    assert "pagoda:spec_decode_num_draft_tokens_total 5.0" in text
    assert "pagoda:spec_decode_acceptance_rate 0.4" in text
    assert "pagoda:spec_decode_mean_accepted_length 2.0" in text
    assert 'pagoda:spec_decode_per_position_acceptance_rate{position="1"} 0.5' in text


def test_a_draft_model_must_share_the_targets_vocabulary_and_reach_its_length(tiny: str, tmp_path) -> None:
    config = create_engine_config(
        model=tiny,
        device="cpu",
        speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": tiny},
    )
    draft = config.speculative_config.draft_model_config
    assert draft.model == config.model_config.model and draft.dtype == config.model_config.dtype
    other_vocab = str(tmp_path / "other-vocab")
    save_random_checkpoint(dataclasses.replace(TINY_CONFIGS["llama3"], vocab_size=300), other_vocab)
    other_tokens = str(tmp_path / "other-tokens")
    save_random_checkpoint(TINY_CONFIGS["llama3"], other_tokens)
    shorter = str(tmp_path / "shorter")
    save_random_checkpoint(dataclasses.replace(TINY_CONFIGS["llama3"], max_position_embeddings=64), shorter)
    refused = [
        (other_vocab, {}, "speculative_config.model .* has vocab_size 300, the target model 256"),
        (shorter, {}, r"speculative_config.model .* reaches 64 positions .* fewer than max_model_len 128"),
        (str(tmp_path / "missing"), {}, "speculative_config.model: "),
    ]
    for draft_path, extra, message in refused:
        with pytest.raises(ConfigError, match=message):
            create_engine_config(
                model=tiny,
                device="cpu",
                **extra,
                speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": draft_path},
            )
    # Two checkpoints whose tokenizer.json number tokens differently.
    for path, vocab in ((tiny, {"a": 0, "b": 1}), (other_tokens, {"a": 1, "b": 0})):
        (pathlib.Path(path) / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab, "merges": []}}))
    with pytest.raises(ConfigError, match=r"speculative_config.model .* has another tokenizer than the target"):
        create_engine_config(
            model=tiny,
            device="cpu",
            speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": other_tokens},
        )
    (pathlib.Path(tiny) / "tokenizer.json").unlink()
    # Within the draft's reach it is fine.
    create_engine_config(
        model=tiny,
        device="cpu",
        max_model_len=64,
        speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": shorter},
    )


def test_serve_refuses_a_bad_draft_naming_the_field(tiny: str, tmp_path, capsys) -> None:
    from pagoda.entrypoints.cli import main

    other_vocab = str(tmp_path / "other-vocab")
    save_random_checkpoint(dataclasses.replace(TINY_CONFIGS["llama3"], vocab_size=300), other_vocab)
    spec = json.dumps({"method": "draft_model", "num_speculative_tokens": 2, "model": other_vocab})
    assert main(["serve", "--model", tiny, "--device", "cpu", "--speculative-config", spec]) == 2
    assert "speculative_config.model" in capsys.readouterr().err
