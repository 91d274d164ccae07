"""The plain data a multimodal request carries from the front end to the runner."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PlaceholderRange:
    """Where an item's encoder output goes in the prompt: `length` tokens from `offset`."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and start < self.end


@dataclass(frozen=True)
class MultiModalFeatureSpec:
    """One processed item of a request (an image): its encoder inputs by name (`pixel_values`,
    and the model's others, e.g. `image_grid_thw`), its content hash (`identifier`: equal for
    equal inputs, the key of the encoder cache and of the prefix cache's block hashes) and its
    placeholder tokens in the prompt."""

    data: dict[str, torch.Tensor]
    modality: str
    identifier: str
    mm_position: PlaceholderRange


@dataclass(frozen=True)
class MultiModalEmbeddings:
    """A step's encoder outputs to write over the token embeddings: `embeddings[i]` replaces the
    input embedding of flat token `token_index[i]` (both on the device); for M-RoPE models
    `positions[:, i]` are that token's (time, height, width) rotary positions."""

    embeddings: torch.Tensor
    token_index: torch.Tensor
    positions: torch.Tensor | None = None
