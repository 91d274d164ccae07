"""Hugging Face checkpoint directories: tensors read lazily from *.safetensors files.

Each tensor comes as a `SafetensorsSlice`, so that a tensor-parallel rank reads only the rows
or columns it keeps: a 70B checkpoint split over 8 ranks is then read once in all, not 8 times.
"""

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


class SafetensorsSlice:
    """One checkpoint tensor, not read yet: `narrow` reads only the part asked for, and
    `materialize` the whole tensor (for parameters every rank holds in full, such as norms).

    It reads through the open file handle it came from, so it is valid only while that file is
    open (see `iter_safetensors_weights`).
    """

    def __init__(self, handle: safe_open, name: str) -> None:
        self._handle = handle
        self._slice = handle.get_slice(name)
        self.name = name
        self.shape = torch.Size(self._slice.get_shape())

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Like `torch.Tensor.narrow`, but reading only those elements from the file."""
        if not 0 <= dim < self.ndim:
            raise IndexError(f"{self.name}: dim must be in [0, {self.ndim}), got {dim}")
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise IndexError(
                f"{self.name}: narrow [{start}, {start + length}) of dim {dim} must lie in [0, {self.shape[dim]}]"
            )
        # PySafeSlice clamps out-of-range slices silently, hence the check above
        return self._slice[(slice(None),) * dim + (slice(start, start + length),)]

    def materialize(self) -> torch.Tensor:
        """The whole tensor."""
        return self._handle.get_tensor(self.name)

    def __repr__(self) -> str:
        return f"SafetensorsSlice({self.name!r}, shape={tuple(self.shape)})"


def iter_safetensors_weights(model_dir: str) -> Iterator[tuple[str, SafetensorsSlice]]:
    """(name, lazy tensor) for every tensor of the checkpoint, one file after another.

    Contract: each file stays open only while the iterator is inside it, so a slice must be
    read (narrowed or materialized) before the iterator moves on to the next file or is
    closed. `load_weights` copies every tensor into its parameter as it comes, which does that.
    """
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, SafetensorsSlice(f, name)
