"""Messages between an `EngineCoreClient` and the engine core process it runs.

Commands go in, reports come out, one PUSH/PULL pipe each way. Commands are numbered by the
order they were sent (the pipe keeps order), so a report can say how many it has applied and
the client knows when the core has seen everything it was told. A UTILITY command (sleep,
wake_up, ...) is answered in the report of the turn that ran it, under its command number.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pagoda.engine.core_request import EngineCoreRequest
from pagoda.outputs import EngineCoreOutput, RequestStatus, SchedulerStats


class CommandKind(enum.Enum):
    ADD = enum.auto()
    ABORT = enum.auto()
    FINISH = enum.auto()  # ended for a reason only the client sees (a stop string)
    CHECK_IDLE = enum.auto()
    UTILITY = enum.auto()  # call `method(*args)` on the core between steps and report the result
    SHUTDOWN = enum.auto()


@dataclass
class CoreCommand:
    kind: CommandKind
    request: EngineCoreRequest | None = None
    request_ids: list[str] = field(default_factory=list)
    status: RequestStatus | None = None
    method: str = ""
    args: tuple[Any, ...] = ()


@dataclass
class UtilityResult:
    """What a UTILITY command returned, or the exception it raised (sent whole when it pickles,
    else as a RuntimeError carrying its type and message)."""

    value: Any = None
    error: BaseException | None = None


@dataclass
class CoreReady:
    """The core built its model and KV cache and is taking commands."""

    num_kv_blocks: int


@dataclass
class CoreReport:
    """What one turn of the core loop did: the step's outputs (a refused request appears as an
    output finished with ERROR and the reason), the scheduler's figures after it, how many
    commands the core has applied in all, and whether it still has work."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    num_commands_applied: int
    has_work: bool
    # Steps the core has completed in all: its heartbeat (see `EngineCoreClient.seconds_without_progress`).
    num_steps: int = 0
    # Answers to CHECK_IDLE commands, by command number: None when idle, else what is left.
    idle_checks: dict[int, str | None] = field(default_factory=dict)
    # Answers to UTILITY commands, by command number.
    utility_results: dict[int, UtilityResult] = field(default_factory=dict)


@dataclass
class CoreFailed:
    """The core hit an error it cannot serve through (the traceback); it exits after sending this."""

    error: str
