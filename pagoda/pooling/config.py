"""Resolving the task and an embedding model's pooling from the checkpoint and user settings.

A sentence-transformers checkpoint says how it pools: `modules.json` lists its modules, the
Pooling module's folder holds `config.json` (`pooling_mode_*` flags) and a Normalize module
means L2 normalization. Without those files: CLS for encoders (BERT), last token for decoders
(Qwen3-Embedding), normalized. User settings (`pooler_config`) win field by field.
"""

from __future__ import annotations

import json
import os
from typing import Any

from transformers import PretrainedConfig

from pagoda.config import ENCODER_MODEL_TYPES, ConfigError, PoolerConfig

# sentence-transformers' Pooling modes -> our pooling type (others, e.g. max, are not built): its
# `pooling_mode` name (6.x), or its older `pooling_mode_*` flag.
_ST_POOLING_MODES = {
    "lasttoken": "LAST",
    "mean": "MEAN",
    "cls": "CLS",
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}


def resolve_task(task: str, hf_config: PretrainedConfig) -> str:
    """ "auto" -> "embed" for encoders, "generate" for decoders; an encoder cannot generate."""
    is_encoder = getattr(hf_config, "model_type", None) in ENCODER_MODEL_TYPES
    if task == "auto":
        return "embed" if is_encoder else "generate"
    if task == "generate" and is_encoder:
        raise ConfigError(f"task 'generate' needs a decoder; {hf_config.model_type!r} is an encoder: use task 'embed'")
    return task


def resolve_pooler_config(
    model: str, hf_config: PretrainedConfig, requested: PoolerConfig | dict[str, Any] | str | None
) -> PoolerConfig:
    """Both fields set: the user's (a PoolerConfig, a dict or its JSON text), else the checkpoint's
    sentence-transformers files, else the family's."""
    if isinstance(requested, str):
        try:
            requested = json.loads(requested)
        except json.JSONDecodeError as error:
            raise ConfigError(f"pooler_config must be a JSON object: {error}") from error
    if isinstance(requested, dict):
        unknown = sorted(set(requested) - {"pooling_type", "normalize"})
        if unknown:
            raise ConfigError(f"unknown pooler_config keys {unknown}; known: ['normalize', 'pooling_type']")
        requested = PoolerConfig(**requested)
    requested = requested or PoolerConfig()
    if not isinstance(requested, PoolerConfig):
        raise ConfigError(f"pooler_config must be a PoolerConfig or a dict, got {type(requested).__name__}")
    is_encoder = getattr(hf_config, "model_type", None) in ENCODER_MODEL_TYPES
    family = PoolerConfig("CLS" if is_encoder else "LAST", True)
    modes, found_normalize = _sentence_transformers_pooling(model) if os.path.isdir(model) else ([], None)
    pooling_type = requested.pooling_type
    if pooling_type is None and modes:
        if len(modes) != 1 or modes[0] not in _ST_POOLING_MODES:
            raise ConfigError(
                f"model: its sentence-transformers pooling {modes} is not supported (one of lasttoken, mean, "
                "cls); set pooler_config={'pooling_type': 'LAST' | 'MEAN' | 'CLS'}"
            )
        pooling_type = _ST_POOLING_MODES[modes[0]]
    normalize = next(n for n in (requested.normalize, found_normalize, family.normalize) if n is not None)
    return PoolerConfig(pooling_type or family.pooling_type, normalize)


def _sentence_transformers_pooling(path: str) -> tuple[list[str], bool | None]:
    """The pooling modes a sentence-transformers folder declares (its name, or its flags set),
    and whether it normalizes; ([], None) without a modules.json."""
    modules_file = os.path.join(path, "modules.json")
    if not os.path.isfile(modules_file):
        return [], None
    with open(modules_file) as f:
        modules = json.load(f)
    types = [module.get("type", "") for module in modules]
    normalize = any(kind.endswith(".Normalize") for kind in types)
    pooling = [module for module in modules if module.get("type", "").endswith(".Pooling")]
    if not pooling:
        return [], normalize
    with open(os.path.join(path, pooling[0].get("path", ""), "config.json")) as f:
        flags = json.load(f)
    mode = flags.get("pooling_mode")
    modes = [mode] if isinstance(mode, str) else [k for k, on in flags.items() if k.startswith("pooling_mode_") and on]
    return modes, normalize
