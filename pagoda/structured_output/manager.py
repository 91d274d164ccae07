"""`StructuredOutputManager`: compiles requests' grammars in threads, off the engine's step loop.

The engine core submits a request's constraint when the request arrives and gets a future; the
scheduler leaves the request waiting until that future is done, while every other request keeps
stepping. Requests of one spec share one future (and the backend's cache keeps the result), so
n > 1 samples and repeated schemas compile once. A compile that fails fails only its request:
the future holds the InvalidRequestError naming the field.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from pagoda.config import ModelConfig
from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output.spec import GrammarSpec

if TYPE_CHECKING:
    import xgrammar as xgr

# xgrammar releases the GIL while it compiles; two threads keep the step loop's core free on small hosts.
DEFAULT_COMPILE_THREADS = 2


class StructuredOutputManager:
    def __init__(self, model_config: ModelConfig, num_threads: int = DEFAULT_COMPILE_THREADS) -> None:
        self.model_config = model_config
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="pagoda-grammar")
        self._futures: dict[GrammarSpec, Future[xgr.CompiledGrammar]] = {}
        self._lock = threading.Lock()

    def submit(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of `params`, on its way; done at once when cached."""
        spec = GrammarSpec.of(params)
        with self._lock:
            future = self._futures.get(spec)
            if future is None or (future.done() and future.exception() is not None):
                future = self._pool.submit(self._compile, spec)
                self._futures[spec] = future
            return future

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        from pagoda.structured_output.backend import get_backend  # xgrammar loads with the first grammar

        compiled = get_backend(self.model_config).compile(spec)
        with self._lock:
            # Done: the backend's cache holds it now; drop the future so the map stays small.
            self._futures.pop(spec, None)
        return compiled

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
