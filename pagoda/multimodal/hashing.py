"""Content hashes of multimodal items, and the part of a KV block's hash they make."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from pagoda.multimodal.inputs import MultiModalFeatureSpec


def hash_tensor(modality: str, data: torch.Tensor) -> str:
    """sha256 over the modality, dtype, shape and bytes of a processed item: what the encoder
    sees, so two files decoding to the same pixels share one entry."""
    contiguous = data.detach().cpu().contiguous()
    header = f"{modality}|{contiguous.dtype}|{tuple(contiguous.shape)}|".encode()
    digest = hashlib.sha256(header)
    digest.update(contiguous.view(torch.uint8).numpy().tobytes() if contiguous.numel() else b"")
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

