"""Tokenizer and end-of-sequence ids of a resolved model."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from pagoda.model.loader.source import resolve_tokenizer

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _has_tokenizer_files(model_dir: str) -> bool:
    return any(os.path.isfile(os.path.join(model_dir, name)) for name in _TOKENIZER_FILES)


def _tokenizer_from(path: str) -> PreTrainedTokenizerBase:
    if path.endswith(".gguf"):
        # The file carries its whole tokenizer (vocabulary, merges, pre-tokenizer, special tokens,
        # chat template), which transformers converts in the fast class; AutoTokenizer would first
        # rebuild an HF config from the file with gguf's slow reader only to pick that class.
        model_dir, file_name = os.path.split(path)
        return PreTrainedTokenizerFast.from_pretrained(model_dir, gguf_file=file_name)
    return AutoTokenizer.from_pretrained(path)


def load_tokenizer(model: str, load_format: str, tokenizer: str | None = None) -> PreTrainedTokenizerBase | None:
    """`tokenizer` (a directory or .gguf file) if given, else the model's own; GGUF tokenizers and
    chat templates come from the file's metadata. None for a model directory without tokenizer files
    or a dummy shape name (prompts must then be token ids)."""
    if tokenizer is not None:
        return _tokenizer_from(resolve_tokenizer(tokenizer))
    if (os.path.isdir(model) and not _has_tokenizer_files(model)) or not os.path.exists(model):
        logger.warning("%s has no tokenizer: prompts must be token ids and outputs carry no text", model)
        return None
    return _tokenizer_from(model)


def _as_id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def get_eos_token_ids(
    model: str, load_format: str, hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase | None
) -> set[int]:
    """Every id that ends a generation: generation_config.json's, the config's (for GGUF, built from
    its metadata's end-of-sequence/turn ids) and the tokenizer's."""
    eos_ids = _as_id_set(getattr(hf_config, "eos_token_id", None))
    generation_config = os.path.join(model, "generation_config.json")
    if os.path.isfile(generation_config):
        with open(generation_config) as f:
            eos_ids |= _as_id_set(json.load(f).get("eos_token_id"))
    if tokenizer is not None:
        eos_ids |= _as_id_set(tokenizer.eos_token_id)
    return eos_ids
