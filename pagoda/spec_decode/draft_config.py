"""The draft model of `method="draft_model"` or the head of "eagle"/"eagle3", resolved and
checked against the target.

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
from collections.abc import Callable
from typing import Any

from transformers import AutoConfig

from pagoda.config import ConfigError, ModelConfig, SpeculativeConfig
from pagoda.model.loader import load_hf_config, resolve_model
from pagoda.model.loader.dummy import DUMMY_SHAPES


def _dummy_head(method: str, target_shape: str, draft_vocab_size: int | None = None) -> Callable[[], dict[str, Any]]:
    """A head at the published shape for a dummy target: its one layer sized as the target's."""

    def config() -> dict[str, Any]:
        shape = {**DUMMY_SHAPES[target_shape], "num_hidden_layers": 1}
        if method == "eagle3":
            shape.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab_size)
        return shape

    return config


# Dummy heads by name (random weights, for benchmarks on dummy targets): yuhuili/EAGLE-LLaMA3.1-
# Instruct-8B and yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (a draft vocabulary of 32000 ids).
DUMMY_HEADS: dict[str, Callable[[], dict[str, Any]]] = {
    "eagle-llama-3.1-8b": _dummy_head("eagle", "llama-3.1-8b"),
    "eagle3-llama-3.1-8b": _dummy_head("eagle3", "llama-3.1-8b", 32000),
}

# Targets whose layer stack is the Llama-style DecoderModel (EAGLE-3 reads its residual stream).
EAGLE_TARGET_TYPES = ("llama", "mistral", "qwen2", "qwen3")


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


def resolve_eagle_head(config: SpeculativeConfig, target: ModelConfig) -> SpeculativeConfig:
    """`config` with the EAGLE head's config as `draft_model_config`: a directory with the head's
    config.json and safetensors in its published layout (see pagoda.model.models.eagle), whose
    sizes must fit the target's; ConfigError naming the field otherwise."""
    assert config.model is not None
    path = os.path.abspath(os.path.expanduser(config.model))
    load_format = "safetensors"
    if config.model in DUMMY_HEADS:
        if target.load_format != "dummy":
            raise ConfigError(
                f"speculative_config.model {config.model!r} is a dummy head (random weights): "
                "the target must load with load_format='dummy'"
            )
        path, load_format = config.model, "dummy"
        fields = DUMMY_HEADS[config.model]()
        hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    elif not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(
            f"speculative_config.model must be a directory with an EAGLE head's config.json (or one of the dummy "
            f"heads {sorted(DUMMY_HEADS)}), got {config.model!r}"
        )
    else:
        hf_config = AutoConfig.from_pretrained(path)
    name = f"speculative_config.model {config.model!r}"
    is_eagle3 = any("eagle3" in arch.lower() for arch in getattr(hf_config, "architectures", None) or [])
    if is_eagle3 != (config.method == "eagle3"):
        kind = "an EAGLE-3 head" if is_eagle3 else "an EAGLE-1 head"
        raise ConfigError(f"speculative_config.method is {config.method!r} but {name} is {kind}")
    target_hidden = target.hf_config.hidden_size
    head_hidden = getattr(hf_config, "target_hidden_size", None) if is_eagle3 else None
    if (head_hidden or hf_config.hidden_size) != target_hidden:
        raise ConfigError(
            f"{name} reads hidden states of size {head_hidden or hf_config.hidden_size}, the target's are {target_hidden}"
        )
    if hf_config.vocab_size != target.vocab_size:
        raise ConfigError(f"{name} has vocab_size {hf_config.vocab_size}, the target model {target.vocab_size}")
    if is_eagle3:
        if getattr(target.hf_config, "model_type", None) not in EAGLE_TARGET_TYPES:
            raise ConfigError(
                f"speculative_config.method 'eagle3' reads a Llama-style target's layers "
                f"({', '.join(EAGLE_TARGET_TYPES)}), not model_type {target.hf_config.model_type!r}"
            )
        draft_vocab = getattr(hf_config, "draft_vocab_size", None) or hf_config.vocab_size
        if not 1 <= draft_vocab <= target.vocab_size:
            raise ConfigError(f"{name} has draft_vocab_size {draft_vocab}: must be in [1, {target.vocab_size}]")
        layers = getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None)
        num_layers = target.num_layers
        if layers is not None and (len(layers) != 3 or not all(0 <= i < num_layers for i in layers)):
            raise ConfigError(
                f"{name}: eagle_aux_hidden_state_layer_ids must be 3 layer indices in [0, {num_layers}), got {layers}"
            )
        if layers is None and num_layers < 4:
            raise ConfigError(
                f"{name}: the target has {num_layers} layers; EAGLE-3's default layers (2, L/2, L-3) need 4 or more "
                "(set eagle_aux_hidden_state_layer_ids in the head's config.json)"
            )
    # Published heads list fewer positions than their targets reach (EAGLE-3 for Llama-3.1: 2048);
    # RoPE is the same formula at any position, so the head's tables cover the target's length.
    hf_config.max_position_embeddings = max(hf_config.max_position_embeddings, target.max_model_len or 0)
    head = ModelConfig(model=path, load_format=load_format, dtype=target.dtype, max_model_len=target.max_model_len)
    head.hf_config = hf_config
    head.seed = target.seed
    return dataclasses.replace(config, draft_model_config=head)
