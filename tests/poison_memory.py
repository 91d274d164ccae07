"""Diagnostic pytest plugin: every CUDA float tensor from torch.empty / empty_like / new_empty
starts as NaN, so a read of memory no kernel wrote shows up as a wrong result at once instead
of as a flake that depends on what earlier tests left in the allocator. Opt in with
`python -m pytest -p poison_memory -m gpu ...` (POISON_CPU=1 poisons CPU tensors too).

A torch function mode rather than patched functions: `torch.device(...)` contexts keep
placing the tensors, and everything else passes through untouched."""

from __future__ import annotations

import os

import torch
from torch.overrides import TorchFunctionMode

POISONED = (torch.empty, torch.empty_like, torch.Tensor.new_empty)
ON_CPU = os.environ.get("POISON_CPU") == "1"


class PoisonMode(TorchFunctionMode):
    """Fills what the allocating functions return; every other call passes through."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in POISONED and isinstance(out, torch.Tensor) and out.is_floating_point() and (out.is_cuda or ON_CPU):
            out.fill_(float("nan"))
        return out


PoisonMode().__enter__()
