"""Tiny random embedding checkpoints for the pooling tests: a Qwen3-Embedding-style decoder (a bare
`Qwen3Model` saved under the causal LM's architecture, as Qwen3-Embedding is) and a BERT with a
WordPiece tokenizer of a few words, both with sentence-transformers' files saying how they pool."""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from model_utils import randomize_
from transformers import AutoModel, BertConfig, BertTokenizerFast, PreTrainedModel, Qwen3Config

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "on",
    "mat",
    "ran",
    "fast",
    "slow",
    "big",
    "small",
    "red",
    "blue",
    "green",
    "house",
    "tree",
    "over",
    "under",
]
BERT_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "##s", "##ed", "##ing"]
BERT_MAX_POSITIONS = 64
QWEN3_MAX_POSITIONS = 128


def write_sentence_transformers_files(path: str, hidden_size: int, pooling_flag: str) -> None:
    """modules.json (Transformer, Pooling, Normalize) and the Pooling module's config, in the
    long-standing layout that published checkpoints (Qwen3-Embedding, all-MiniLM) ship."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    flags = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens", "pooling_mode_lasttoken")
    pooling = {"word_embedding_dimension": hidden_size, **{flag: flag == pooling_flag for flag in flags}}
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    os.makedirs(os.path.join(path, "2_Normalize"), exist_ok=True)
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump(pooling, f)
    with open(os.path.join(path, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 64, "do_lower_case": False}, f)


def _save_random(config, path: str, seed: int = 1234) -> PreTrainedModel:
    torch.manual_seed(seed)
    model = AutoModel.from_config(config, dtype=torch.float32)
    randomize_(model)
    model.eval()
    model.save_pretrained(path)
    return model


def save_tiny_qwen3_embedding(path: str) -> PreTrainedModel:
    """A bare Qwen3Model (weights without the "model." prefix, no LM head) whose config names
    Qwen3ForCausalLM, pooling its last token, normalized; returns the HF model."""
    config = Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=QWEN3_MAX_POSITIONS,
        tie_word_embeddings=True,
    )
    model = _save_random(config, path)
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        saved = json.load(f)
    saved["architectures"] = ["Qwen3ForCausalLM"]
    with open(config_file, "w") as f:
        json.dump(saved, f)
    write_sentence_transformers_files(path, config.hidden_size, "pooling_mode_lasttoken")
    return model


def save_tiny_bert(path: str, pooling_flag: str = "pooling_mode_mean_tokens") -> PreTrainedModel:
    """A BertModel with a WordPiece tokenizer over BERT_VOCAB, pooling as `pooling_flag` says,
    normalized; returns the HF model."""
    os.makedirs(path, exist_ok=True)
    vocab_file = os.path.join(path, "vocab.txt")
    with open(vocab_file, "w") as f:
        f.write("\n".join(BERT_VOCAB) + "\n")
    BertTokenizerFast(vocab_file).save_pretrained(path)
    config = BertConfig(
        vocab_size=len(BERT_VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=BERT_MAX_POSITIONS,
    )
    model = _save_random(config, path)
    write_sentence_transformers_files(path, config.hidden_size, pooling_flag)
    return model


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@torch.inference_mode()
def hf_last_token_embedding(model: PreTrainedModel, token_ids: list[int]) -> np.ndarray:
    hidden = model(input_ids=torch.tensor([token_ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=-1).numpy()
