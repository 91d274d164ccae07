"""Messages between an `EngineCoreClient` and the engine core process it runs.

Commands go in, reports come out, one PUSH/PULL pipe each way. Commands are numbered by the
order they were sent (the pipe keeps order), so a report can say how many it has applied and
the client knows when the core has seen everything it was told. A UTILITY command (sleep,
wake_up, ...) is answered in the report of the turn that ran it, under its command number.
"""

from __future__ import annotations

import enum
from array import array
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

    def __getstate__(self) -> dict[str, Any]:
        """Pickled with `outputs` packed by `pack_outputs`: the core pickles a report every step."""
        return {**self.__dict__, "outputs": pack_outputs(self.outputs)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, outputs=unpack_outputs(state["outputs"]))


PackedOutputs = tuple[list[str], array, array, list[tuple[int, EngineCoreOutput]]]


def pack_outputs(outputs: list[EngineCoreOutput]) -> PackedOutputs:
    """Outputs as (request ids, token counts, tokens, [(position, output)]): those that carry
    only new tokens (a decode step's, but for the few finishing) in three columns, the others
    whole at their place in the list. The columns pickle in about two thirds of the time the
    objects take (each a dict of nine fields) and load in about a third
    (benchmarks/core_report_pickle.py)."""
    request_ids: list[str] = []
    counts = array("i")
    tokens = array("q")
    whole: list[tuple[int, EngineCoreOutput]] = []
    for position, output in enumerate(outputs):
        # Every field but req_id and new_token_ids (tests/engine/test_core_messages.py lists them).
        if (
            output.finish_reason is not None
            or output.stop_reason is not None
            or output.error is not None
            or output.new_logprobs is not None
            or output.new_prompt_logprobs is not None
            or output.pooling_output is not None
            or output.kv_transfer_params is not None
        ):
            whole.append((position, output))
        else:
            request_ids.append(output.req_id)
            counts.append(len(output.new_token_ids))
            tokens.extend(output.new_token_ids)
    return request_ids, counts, tokens, whole


def unpack_outputs(packed: PackedOutputs) -> list[EngineCoreOutput]:
    """`pack_outputs`'s outputs again, in their order."""
    request_ids, counts, tokens, whole = packed
    token_ids = tokens.tolist()
    outputs = []
    start = 0
    for request_id, count in zip(request_ids, counts, strict=True):
        outputs.append(EngineCoreOutput(request_id, token_ids[start : start + count]))
        start += count
    for position, output in whole:  # ascending positions: each lands where it was
        outputs.insert(position, output)
    return outputs


@dataclass
class CoreFailed:
    """The core hit an error it cannot serve through (the traceback); it exits after sending this."""

    error: str
