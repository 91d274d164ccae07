"""The draft model of `method="draft_model"`, resolved and checked against the target.

A draft proposes token ids that the target verifies, so both must number tokens alike: the same
vocabulary size, and where both checkpoints carry a `tokenizer.json`, the same vocabulary. The
draft also runs at every position the target does, so its positions must reach max_model_len.
It loads like the target (a dummy target gets a dummy draft: benchmarks on published shapes) and
in the target's dtype. Every refusal names `speculative_config.model`.
"""

from __future__ import annotations

import dataclasses
import json
import os

from pagoda.config import ConfigError, ModelConfig, SpeculativeConfig
from pagoda.model.loader import load_hf_config, resolve_model


def resolve_draft_model(config: SpeculativeConfig, target: ModelConfig) -> SpeculativeConfig:
    """`config` with its `draft_model_config` set; ConfigError naming the field on a mismatch."""
    assert config.model is not None
    load_format = "dummy" if target.load_format == "dummy" else "auto"
    draft = ModelConfig(
        model=config.model, load_format=load_format, dtype=target.dtype, max_model_len=target.max_model_len
    )
    try:
        draft.model, draft.load_format = resolve_model(config.model, load_format)
        draft.hf_config = load_hf_config(draft.model, draft.load_format)
    except ConfigError as error:
        raise ConfigError(f"speculative_config.model: {error}") from error
    draft.seed = target.seed
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(
            f"speculative_config.model {config.model!r} has vocab_size {draft.vocab_size}, the target model "
            f"{target.vocab_size}: a draft must share the target's tokenizer"
        )
    assert target.max_model_len is not None
    if draft.derived_max_model_len < target.max_model_len:
        raise ConfigError(
            f"speculative_config.model {config.model!r} reaches {draft.derived_max_model_len} positions "
            f"(max_position_embeddings), fewer than max_model_len {target.max_model_len}: lower max_model_len"
        )
    _check_same_vocabulary(config.model, draft.model, target.model)
    return dataclasses.replace(config, draft_model_config=draft)


def _check_same_vocabulary(name: str, draft_path: str, target_path: str | None) -> None:
    """Where both models are directories with a tokenizer.json, their token -> id maps must match."""
    vocabularies = []
    for path in (draft_path, target_path):
        file = os.path.join(path, "tokenizer.json") if path and os.path.isdir(path) else None
        if file is None or not os.path.isfile(file):
            return
        with open(file, encoding="utf-8") as f:
            model = json.load(f).get("model", {})
        vocabularies.append((model.get("vocab"), json.dumps(model.get("merges"))))
    if vocabularies[0] != vocabularies[1]:
        raise ConfigError(
            f"speculative_config.model {name!r} has another tokenizer than the target model "
            "(their tokenizer.json vocabularies differ): a draft must share the target's tokenizer"
        )
