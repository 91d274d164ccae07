"""The pooler over flat hidden states, and the pooling config read from sentence-transformers files."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import BertConfig, Qwen3Config

from pagoda.config import ConfigError, PoolerConfig
from pagoda.pooling.config import resolve_pooler_config, resolve_task
from pagoda.pooling.pooler import Pooler

STARTS, ENDS = np.array([0, 3, 4]), np.array([3, 4, 9])


@pytest.mark.parametrize(
    ("pooling_type", "reference"),
    [
        ("LAST", lambda h, s, e: h[e - 1]),
        ("CLS", lambda h, s, e: h[s]),
        ("MEAN", lambda h, s, e: h[s:e].mean(0)),
    ],
)
def test_each_span_pools_its_own_tokens(pooling_type: str, reference) -> None:
    hidden = torch.randn(10, 6)  # token 9 is padding past the last span
    pooled = Pooler(PoolerConfig(pooling_type, False)).pool(hidden, STARTS, ENDS)
    for row, (start, end) in enumerate(zip(STARTS, ENDS, strict=True)):
        torch.testing.assert_close(pooled[row], reference(hidden, start, end))


def test_finish_cuts_then_normalizes_per_request() -> None:
    pooled = torch.randn(3, 6)
    vectors = Pooler(PoolerConfig("LAST", True)).finish(pooled, [None, 4, 4], [None, False, None])
    np.testing.assert_allclose(vectors[0], (pooled[0] / pooled[0].norm()).numpy(), rtol=1e-6)
    np.testing.assert_allclose(vectors[1], pooled[1, :4].numpy())
    np.testing.assert_allclose(vectors[2], (pooled[2, :4] / pooled[2, :4].norm()).numpy(), rtol=1e-6)


def test_the_pooling_comes_from_sentence_transformers_files(tmp_path) -> None:
    qwen3, bert = Qwen3Config(), BertConfig()
    assert resolve_pooler_config(str(tmp_path), qwen3, None) == PoolerConfig("LAST", True)
    assert resolve_pooler_config(str(tmp_path), bert, None) == PoolerConfig("CLS", True)
    # sentence-transformers 6.x: the mode by name, and no Normalize module.
    modules = [{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.x.Pooling"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "mean"}))
    assert resolve_pooler_config(str(tmp_path), bert, None) == PoolerConfig("MEAN", False)
    assert resolve_pooler_config(str(tmp_path), bert, '{"normalize": true}') == PoolerConfig("MEAN", True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "max"}))
    with pytest.raises(ConfigError, match="sentence-transformers pooling"):
        resolve_pooler_config(str(tmp_path), bert, None)
    assert resolve_pooler_config(str(tmp_path), bert, {"pooling_type": "CLS"}).pooling_type == "CLS"


def test_encoders_embed_and_cannot_generate() -> None:
    assert resolve_task("auto", BertConfig()) == "embed"
    assert resolve_task("auto", Qwen3Config()) == "generate"
    assert resolve_task("embed", Qwen3Config()) == "embed"
    with pytest.raises(ConfigError, match="is an encoder"):
        resolve_task("generate", BertConfig())
