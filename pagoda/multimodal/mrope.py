"""M-RoPE positions (Qwen2-VL, Qwen2.5-VL): an image's placeholder tokens are rotated by their
(time, height, width) place in the image's grid of merged patches, all three starting where the
image starts; the text after an image continues from the image's start + its larger side. So
a token's text position is its index plus a shift that changes only after each image (and is
never positive: an image takes fewer positions than tokens). Text tokens, whose three positions
are equal, rotate as with plain RoPE at that shifted position: only image tokens need the three.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagoda.multimodal.inputs import MultiModalFeatureSpec


@dataclass(frozen=True)
class MRopeLayout:
    """One request's images as M-RoPE sees them, in placeholder order."""

    # End (token index) of each image's placeholders; the shift of the positions after 0, 1, ... images.
    ends: np.ndarray
    shifts: np.ndarray
    # Each image's first rotary position and (time, height, width) grid of merged patches.
    starts: tuple[int, ...]
    grids: tuple[tuple[int, int, int], ...]

    def text_positions(self, token_index: np.ndarray) -> np.ndarray:
        """Rotary positions of tokens (as their plain positions: an image token's are its `image_positions`)."""
        return token_index + self.shifts[np.searchsorted(self.ends, token_index, side="right")]

    def image_positions(self, image: int, first: int, last: int) -> np.ndarray:
        """[3, last - first] (time, height, width) positions of placeholders first..last-1 of `image`."""
        _, height, width = self.grids[image]
        j = np.arange(first, last, dtype=np.int64)
        return self.starts[image] + np.stack([j // (height * width), (j // width) % height, j % width])


def mrope_layout(features: Sequence[MultiModalFeatureSpec], spatial_merge_size: int) -> MRopeLayout:
    ends, shifts, starts, grids = [], [0], [], []
    for feature in features:
        t, h, w = (int(x) for x in feature.data["image_grid_thw"])
        grid = (t, h // spatial_merge_size, w // spatial_merge_size)
        position = feature.mm_position
        start = position.offset + shifts[-1]
        starts.append(start)
        grids.append(grid)
        ends.append(position.end)
        shifts.append(start + max(grid[1], grid[2]) - position.end)
    return MRopeLayout(np.array(ends, dtype=np.int64), np.array(shifts, dtype=np.int64), tuple(starts), tuple(grids))
