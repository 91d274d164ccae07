"""Speculative settings: bad ones are refused naming the field and the limit; unbuilt methods too."""

from __future__ import annotations

import pytest
from model_utils import save_tiny_checkpoint

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


def test_the_engine_refuses_what_is_not_built_or_does_not_fit(tiny: str) -> None:
    config = create_engine_config(
        model=tiny, device="cpu", speculative_config='{"method": "ngram", "num_speculative_tokens": 4}'
    )
    assert config.speculative_config == SpeculativeConfig("ngram", 4)
    for method in ("draft_model", "eagle", "eagle3"):
        with pytest.raises(ConfigError, match=f"method '{method}' is not built yet"):
            create_engine_config(
                model=tiny,
                device="cpu",
                speculative_config={"method": method, "num_speculative_tokens": 2, "model": tiny},
            )
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
