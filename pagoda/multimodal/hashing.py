"""Content hashes of multimodal items, and the part of a KV block's hash they make."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from pagoda.multimodal.inputs import MultiModalFeatureSpec


def hash_item(modality: str, data: dict[str, torch.Tensor]) -> str:
    """sha256 over the modality and each input's name, dtype, shape and bytes: what the encoder
    sees, so two files decoding to the same pixels share one entry."""
    digest = hashlib.sha256(modality.encode())
    for name in sorted(data):
        tensor = data[name].detach().cpu().contiguous()
        digest.update(f"|{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def block_mm_keys(features: Sequence[MultiModalFeatureSpec], start: int, end: int) -> bytes:
    """The identifiers of the items whose placeholders cover part of tokens [start, end), with the
    offset each starts at relative to the block: a block of image placeholders hashes equal only
    for the same image at the same place (the placeholder token ids alone are all alike)."""
    keys = [
        f"{feature.identifier}@{feature.mm_position.offset - start}"
        for feature in features
        if feature.mm_position.overlaps(start, end)
    ]
    return ";".join(keys).encode()
