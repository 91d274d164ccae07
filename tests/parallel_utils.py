"""Shared by the tests that kill a rank mid-generation (multiprocess and Ray executors)."""

from __future__ import annotations

import threading
from collections.abc import Callable


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

    def wait(self, timeout_s: float) -> BaseException:
        """What generation raised; fails the test unless it raised within `timeout_s`."""
        assert self.finished.wait(timeout_s), f"the engine did not fail within {timeout_s} s of the kill"
        self.thread.join()
        assert self.error is not None
        return self.error
