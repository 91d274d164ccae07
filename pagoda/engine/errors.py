"""How the engine fails: as a whole (`EngineDeadError`) or one request at a time (`RequestFailedError`).

Kept apart from the core client so that the in-process engine raises the same errors
without importing ZeroMQ.
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core died (its process exited, or its step raised); nothing more can be served."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (e.g. its detokenization raised); the others run on."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id!r} failed in the engine: {reason}")
        self.request_id = request_id
        self.reason = reason


class EngineSleepingError(RuntimeError):
    """A request reached an engine whose memory is asleep (see `EngineCore.sleep`)."""


class WorkerFailedError(RuntimeError):
    """A worker rank died or its step raised: the engine cannot step without every rank."""
