"""Whether the model being built computes batch-invariantly (`ModelConfig.batch_invariant`).

Layers that multiply by a weight read it once, at construction, as they read the quantization
in effect (`quantization.base.building_with`), so models never pass it down their constructors
and two engines of one process may run in different modes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_building: list[bool] = [False]


@contextmanager
def building_batch_invariant(enabled: bool) -> Iterator[None]:
    """Layers built inside run their GEMMs batch-invariantly when `enabled`."""
    _building.append(enabled)
    try:
        yield
    finally:
        _building.pop()


def batch_invariant_now() -> bool:
    """Whether the layer being built now runs its GEMMs batch-invariantly."""
    return _building[-1]
