"""Hugging Face checkpoint directories: tensors read memory-mapped from *.safetensors files."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from pagoda.config import ConfigError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str) -> list[str]:
    """model.safetensors, else the shards its index names, else every *.safetensors file."""
    single = os.path.join(model_dir, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, shard) for shard in shards]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ConfigError(f"model: no *.safetensors weights in {model_dir}")
    return files


def iter_safetensors_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor backed by the memory-mapped file) for every tensor of the checkpoint."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)
