"""Sampling defaults a model recommends: its generation_config.json (HF) or GGUF metadata.

As vLLM does, only the fields that shape the distribution are taken (temperature, top_p, top_k,
min_p, repetition_penalty); `do_sample` is ignored (a temperature decides greedy), and
`max_new_tokens` too: a default cap fixed without the prompt's length would refuse long prompts.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pagoda.config import ConfigError
from pagoda.errors import InvalidRequestError
from pagoda.sampling_params import SamplingParams

SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
GENERATION_CONFIG_FILE = "generation_config.json"
# --generation-config values that are not a folder.
GENERATION_CONFIG_MODES = ("auto", "vllm")


def load_sampling_defaults(model: str, load_format: str, generation_config: str = "auto") -> dict[str, Any]:
    """SamplingParams fields to use where a request leaves them unset, for a resolved model
    (see `resolve_model`): "auto" reads the model's own, "vllm" none, any other value is a
    folder that must hold a generation_config.json. ConfigError for values SamplingParams refuses."""
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        defaults = _model_defaults(model, load_format)
        source = model
    else:
        source = os.path.join(os.path.abspath(os.path.expanduser(generation_config)), GENERATION_CONFIG_FILE)
        if not os.path.isfile(source):
            raise ConfigError(
                f"generation_config must be 'auto', 'vllm' or a folder with a {GENERATION_CONFIG_FILE}, "
                f"got {generation_config!r} (no {source})"
            )
        defaults = _read_json_defaults(source)
    _check(defaults, source)
    return defaults


def _model_defaults(model: str, load_format: str) -> dict[str, Any]:
    if load_format == "gguf":
        from pagoda.model.loader.gguf_loader import read_gguf_sampling_defaults

        return read_gguf_sampling_defaults(model)
    path = os.path.join(model, GENERATION_CONFIG_FILE)
    return _read_json_defaults(path) if os.path.isfile(path) else {}


def _read_json_defaults(path: str) -> dict[str, Any]:
    with open(path) as file:
        config = json.load(file)
    return {name: config[name] for name in SAMPLING_DEFAULT_FIELDS if config.get(name) is not None}


def _check(defaults: dict[str, Any], source: str) -> None:
    """Refuse at startup what would make every request that relies on the defaults fail."""
    try:
        SamplingParams(**defaults)
    except InvalidRequestError as error:
        raise ConfigError(f"generation_config: {source} sets an invalid sampling default: {error}") from error
