"""Diagnostic pytest plugin: engines are not shut down when dropped, as before engines got a
finalizer (2026-12-01): each one lives on until the cyclic garbage collector frees it (model,
KV cache, CUDA graphs and their memory pool), and here the collector also runs at random steps
of the engines that come later (probability GRAVEYARD_GC_P, default 0.2), so whatever a dying
engine's teardown does to a running one shows up as a wrong result. Opt in with
`python -m pytest -p gpu_graveyard -m gpu ...`."""

from __future__ import annotations

import gc
import os
import random

from pagoda.entrypoints.llm import LLM
from pagoda.worker.gpu_model_runner import GPUModelRunner

GC_PROBABILITY = float(os.environ.get("GRAVEYARD_GC_P", "0.2"))
_rng = random.Random(0)
_llm_init = LLM.__init__
_execute_model = GPUModelRunner.execute_model


def _init_without_finalizer(self: LLM, *args, **kwargs) -> None:
    _llm_init(self, *args, **kwargs)
    self._shutdown.detach()


def _execute_model_with_collections(self: GPUModelRunner, *args, **kwargs):
    if _rng.random() < GC_PROBABILITY:
        gc.collect()
    return _execute_model(self, *args, **kwargs)


LLM.__init__ = _init_without_finalizer
GPUModelRunner.execute_model = _execute_model_with_collections
