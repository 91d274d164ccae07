"""Shared by the executor tests on the CPU (multiprocess and Ray executors): the engine settings,
prompts and greedy run every split is compared on, and generation that runs until a killed rank
fails the engine."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

from server_utils import wait_until

from pagoda import LLM, SamplingParams

ENGINE = {"device": "cpu", "dtype": "float32", "max_model_len": 128, "num_gpu_blocks": 64}
# Seconds a killed rank may take to fail the engine: a hang fails the test, a loaded machine does not.
FAILURE_DEADLINE_S = 120


def make_prompts(count: int = 6) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1, 256) for _ in range(rng.randint(1, 40))] for _ in range(count)]


def greedy(llm: LLM, prompts: list, max_tokens: int = 10) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]


class GenerationUntilFailure:
    """Runs `generate()` again and again in a thread until it raises (a killed rank fails the
    engine), so the kill always lands while requests are in flight."""

    def __init__(self, generate: Callable[[], object]) -> None:
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(generate,))
        self.thread.start()

    def _run(self, generate: Callable[[], object]) -> None:
        try:
            while True:
                generate()
        except BaseException as error:
            self.error = error
        self.finished.set()

    def wait_in_flight(self, llm: LLM) -> None:
        """Until `llm` holds the generation's requests: a kill from then on lands while they run
        (an event, not a fixed sleep that a loaded machine may not fill)."""
        assert wait_until(llm.llm_engine.has_unfinished_requests, FAILURE_DEADLINE_S, interval_s=0.01)

    def wait(self, timeout_s: float) -> BaseException:
        """What generation raised; fails the test unless it raised within `timeout_s`."""
        assert self.finished.wait(timeout_s), f"the engine did not fail within {timeout_s} s of the kill"
        self.thread.join()
        assert self.error is not None
        return self.error
