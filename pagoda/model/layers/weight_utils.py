"""Copying checkpoint tensors into parameters, with the shape check `Tensor.copy_` lacks.

`copy_` broadcasts silently, so a checkpoint tensor of the wrong shape could fill a parameter
without complaint; every weight loader goes through `copy_weight` instead.

A checkpoint tensor is either a real tensor (GGUF, weights updated from memory) or a
`LazyWeight` not read yet (safetensors). Loaders take this rank's part with `narrow_weight`,
which reads only that part of a lazy weight, so a tensor-parallel rank never reads the rest.
"""

from __future__ import annotations

from typing import Protocol, TypeAlias

import torch


class LazyWeight(Protocol):
    """A checkpoint tensor read on demand (`SafetensorsSlice`)."""

    @property
    def shape(self) -> torch.Size: ...

    @property
    def ndim(self) -> int: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Read only entries [start, start + length) of `dim`."""
        ...

    def materialize(self) -> torch.Tensor:
        """Read the whole tensor."""
        ...


CheckpointWeight: TypeAlias = torch.Tensor | LazyWeight


def narrow_weight(weight: CheckpointWeight, dim: int, start: int, length: int) -> torch.Tensor:
    """Entries [start, start + length) of `dim`: a view of a real tensor, or just those
    entries read from the file for a lazy one."""
    return weight.narrow(dim, start, length)


def whole_weight(weight: CheckpointWeight) -> torch.Tensor:
    """The whole tensor: `weight` itself, or a lazy one read from its file."""
    return weight if isinstance(weight, torch.Tensor) else weight.materialize()


def copy_weight(dst: torch.Tensor, src: CheckpointWeight) -> None:
    """Copy `src` into `dst` (any device/dtype); raise ValueError if the shapes differ.

    A lazy `src` is read whole only here, after its shape has been checked. An FP8 parameter
    takes FP8 tensors only."""
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: parameter expects {tuple(dst.shape)}, checkpoint has {tuple(src.shape)}")
    src = whole_weight(src)
    if dst.dtype == torch.float8_e4m3fn and src.dtype != dst.dtype:
        # A cast would drop the scales: a weight quantized at load cannot be refilled from the
        # unquantized checkpoint in place (sleep level 2, update_weights).
        raise ValueError(f"an FP8 parameter takes only float8_e4m3fn checkpoint tensors, got {src.dtype}")
    dst.copy_(src)


def default_weight_loader(param: torch.nn.Parameter, loaded_weight: CheckpointWeight, shard_id: None = None) -> None:
    """Loader for parameters that are not sharded (norm weights)."""
    if shard_id is not None:
        raise ValueError(f"parameter is not sharded, got shard_id {shard_id!r}")
    copy_weight(param.data, loaded_weight)


def load_checkpoint_weight(
    param: torch.nn.Parameter, loaded_weight: CheckpointWeight, hf_name: str, shard_id: object = None
) -> None:
    """Fill `param` (or its `shard_id` part) through its own `weight_loader`, else
    `default_weight_loader`; a mismatch's error names the checkpoint weight `hf_name`."""
    loader = getattr(param, "weight_loader", default_weight_loader)
    try:
        loader(param, loaded_weight, shard_id)
    except ValueError as e:
        raise ValueError(f"checkpoint weight {hf_name!r}: {e}") from e
