"""Pagoda: a fast LLM inference engine.

The public names load on first use (PEP 562): `import pagoda` alone, as the CLI does before it
has read its arguments, costs no torch import, so `pagoda serve` can start its engine core
process first and build the rest while the core loads the model.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

# OpenMP threads waiting for work sleep instead of spinning. Read once, when torch loads its
# OpenMP runtime, so it takes effect when pagoda is imported first (the CLI, `from pagoda import
# LLM`) and in every child process. On cores shared with other processes a spinning thread holds
# the core its descheduled peer needs to reach the barrier: measured on a 2-core machine at load
# ~7, 2 torch threads decoded SmolLM2 ~5x (batch 32) and ~10x (batch 1) slower spinning than
# sleeping. The price is a wake-up per parallel region (~100 us for a batch-1 step's attention
# on the same machine): on dedicated cores set OMP_WAIT_POLICY=ACTIVE, or GOMP_SPINCOUNT=10000 for
# a short spin, which libgomp honours over the policy (benchmarks/RESULTS.md, 2026-12-07).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Whether torch's OpenMP threads sleep between parallel regions in this process: the policy took
# effect (torch was not loaded before pagoda) and no spin count overrides it. The GGUF kernels'
# own helper threads spin between a decode step's layers only then (`gguf_kernels.spin_us`):
# beside OpenMP threads that spin too, a SmolLM2 single stream on 2 cores took 60-75 ms a token
# against 36-43 with the helpers sleeping at once (benchmarks/RESULTS.md, 2026-12-07).
OPENMP_THREADS_SLEEP = (
    "torch" not in sys.modules
    and os.environ["OMP_WAIT_POLICY"].upper() == "PASSIVE"
    and "GOMP_SPINCOUNT" not in os.environ
)

if TYPE_CHECKING:
    from pagoda.entrypoints.llm import LLM
    from pagoda.lora.request import LoRARequest
    from pagoda.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput, ScoringRequestOutput
    from pagoda.pooling_params import PoolingParams
    from pagoda.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "LoRARequest",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
]
__version__ = "0.1.0"

# Where each public name lives.
_MODULES = {
    "LLM": "pagoda.entrypoints.llm",
    "LoRARequest": "pagoda.lora.request",
    "CompletionOutput": "pagoda.outputs",
    "RequestOutput": "pagoda.outputs",
    "EmbeddingRequestOutput": "pagoda.outputs",
    "ScoringRequestOutput": "pagoda.outputs",
    "PoolingParams": "pagoda.pooling_params",
    "SamplingParams": "pagoda.sampling_params",
    "StructuredOutputsParams": "pagoda.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module 'pagoda' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULES[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value
