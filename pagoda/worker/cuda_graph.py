"""CUDA-graph execution modes. Capture and replay arrive with the GPU fast path; until then
every batch runs eagerly and `_determine_batch_execution_and_padding` returns NONE."""

from __future__ import annotations

import enum


class CUDAGraphMode(enum.Enum):
    NONE = 0  # run the model eagerly
    FULL = 1  # replay one captured graph of the whole forward
