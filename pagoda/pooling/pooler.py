"""`Pooler`: a step's hidden states -> one vector per request whose prompt completed."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
import torch.nn.functional as F

from pagoda.config import PoolerConfig


class Pooler:
    """Pools flat hidden states [T, hidden] over per-request token spans [starts, ends)."""

    def __init__(self, config: PoolerConfig) -> None:
        assert config.pooling_type is not None and config.normalize is not None, "resolve the pooler config first"
        self.pooling_type = config.pooling_type
        self.normalize = config.normalize

    def pool(self, hidden_states: torch.Tensor, starts: np.ndarray, ends: np.ndarray) -> torch.Tensor:
        """[rows, hidden] float32: each span's last token, first token, or mean."""
        device = hidden_states.device
        if self.pooling_type == "LAST":
            return hidden_states[torch.from_numpy(ends - 1).to(device)].float()
        if self.pooling_type == "CLS":
            return hidden_states[torch.from_numpy(starts).to(device)].float()
        lengths = ends - starts
        rows = np.repeat(np.arange(len(starts)), lengths)
        offsets = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        tokens = np.repeat(starts, lengths) + offsets
        sums = torch.zeros(len(starts), hidden_states.shape[1], dtype=torch.float32, device=device)
        sums.index_add_(
            0, torch.from_numpy(rows).to(device), hidden_states[torch.from_numpy(tokens).to(device)].float()
        )
        return sums / torch.from_numpy(lengths).to(device, torch.float32)[:, None]

    def finish(
        self, pooled: torch.Tensor, dimensions: list[int | None], normalize: list[bool | None]
    ) -> list[np.ndarray]:
        """Each row cut to its `dimensions` (None: all) and, where its `normalize` (None: the
        model's) says so, L2-normalized after the cut; as float32 host arrays, one copy per kind."""
        kinds: dict[tuple[int, bool], list[int]] = defaultdict(list)
        for row, (dims, norm) in enumerate(zip(dimensions, normalize, strict=True)):
            kinds[(dims or pooled.shape[1], self.normalize if norm is None else norm)].append(row)
        results: list[np.ndarray] = [np.empty(0, dtype=np.float32)] * len(dimensions)
        for (dims, norm), rows in kinds.items():
            part = pooled[torch.tensor(rows, device=pooled.device), :dims]
            if norm:
                part = F.normalize(part, dim=-1)
            for row, vector in zip(rows, part.cpu().numpy(), strict=True):
                results[row] = vector
        return results
