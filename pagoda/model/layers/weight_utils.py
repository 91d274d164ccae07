"""Copying checkpoint tensors into parameters, with the shape check `Tensor.copy_` lacks.

`copy_` broadcasts silently, so a checkpoint tensor of the wrong shape could fill a parameter
without complaint; every weight loader goes through `copy_weight` instead.
"""

from __future__ import annotations

import torch


def copy_weight(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src` into `dst` (any device/dtype); raise ValueError if the shapes differ."""
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: parameter expects {tuple(dst.shape)}, checkpoint has {tuple(src.shape)}")
    dst.copy_(src)


def default_weight_loader(param: torch.nn.Parameter, loaded_weight: torch.Tensor, shard_id: None = None) -> None:
    """Loader for parameters that are not sharded (norm weights)."""
    if shard_id is not None:
        raise ValueError(f"parameter is not sharded, got shard_id {shard_id!r}")
    copy_weight(param.data, loaded_weight)
