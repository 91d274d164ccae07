"""The engine core in a process of its own: apply commands, step, report — in a busy loop.

The server process does HTTP, tokenization and detokenization; this process does nothing but
drive `EngineCore`, so none of that work ever holds the GIL the device loop needs.

Transport: ZeroMQ PUSH/PULL over ipc files in a private (0700) directory, messages pickled.
Both ends are this codebase, and pickle carries `EngineCoreRequest` and `SamplingParams` whole
as they grow new fields, where a msgspec schema would have to mirror each one. The core removes
that directory on every way out it sees (shutdown, a failure, SIGTERM, its parent's death: the
parent may be gone without a word, as after `kill -9`); the client removes it too on shutdown.

Any exception in a step (the model forward) ends the process: it sends `CoreFailed` with
the traceback and exits 1, and the client fails every request in flight. For fault-injection
tests only, PAGODA_TEST_CORE_FAULT="raise@N" makes the N-th model forward raise and
"hang@N" makes it never return (see `inject_test_fault`); nothing else reads it.
PAGODA_DEBUG_CHECK_IDLE=1 runs `EngineCore.check_idle()` whenever the core goes idle.

Utility calls (`UTILITY_METHODS`: sleep, wake_up, ...) run in command order between steps;
an exception they raise goes back to the caller and the core serves on.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import time
import traceback
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import zmq

from pagoda.config import ConfigError, EngineConfig
from pagoda.engine.core_messages import CommandKind, CoreCommand, CoreFailed, CoreReady, CoreReport, UtilityResult
from pagoda.engine.debug import debug_check_idle_enabled
from pagoda.engine.errors import EngineSleepingError
from pagoda.outputs import EngineCoreOutput, FinishReason
from pagoda.process_exit import exit_process, freeze_startup_objects

if TYPE_CHECKING:
    from pagoda.engine.core import EngineCore

logger = logging.getLogger(__name__)

# How long an idle core waits for a command before it looks whether its parent still lives.
IDLE_POLL_MS = 500
TEST_FAULT_ENV = "PAGODA_TEST_CORE_FAULT"
# EngineCore methods a client may call through a UTILITY command.
UTILITY_METHODS = frozenset({"sleep", "wake_up", "is_sleeping", "update_weights"})


def ipc_addresses(ipc_dir: str) -> tuple[str, str]:
    """The commands and reports pipes' addresses in the client's private directory."""
    return f"ipc://{ipc_dir}/commands", f"ipc://{ipc_dir}/reports"


def send(socket: zmq.Socket, message: Any, flags: int = 0) -> None:
    socket.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), flags, copy=False)


def open_socket(context: zmq.Context, kind: int, address: str, bind: bool, linger_ms: int = 0) -> zmq.Socket:
    """A pipe end whose queues are unbounded (a send never blocks or drops), keeping unsent
    messages for `linger_ms` after it is closed."""
    socket = context.socket(kind)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.LINGER, linger_ms)
    if bind:
        socket.bind(address)
    else:
        socket.connect(address)
    return socket


class EngineCoreLoop:
    def __init__(self, core: EngineCore, commands: zmq.Socket, reports: zmq.Socket, parent_pid: int) -> None:
        self.core = core
        self.commands = commands
        self.reports = reports
        self.parent_pid = parent_pid
        self.num_commands_applied = 0
        self.num_steps = 0
        self.debug_check_idle = debug_check_idle_enabled()
        # Idle checks are answered once the core has no work left: a check sent right after the
        # last abort may find a finished request still to report or a batch still in flight.
        self.pending_idle_checks: list[int] = []

    def run(self) -> None:
        """Until SHUTDOWN or the parent's death: apply what arrived, step while there is work,
        report every turn that did something."""
        while os.getppid() == self.parent_pid:
            idle = not self.core.has_work()
            if not self.commands.poll(IDLE_POLL_MS if idle else 0) and idle:
                self.core.executor.check_health()  # a worker that died while idle ends the core now
                continue
            outputs: list[EngineCoreOutput] = []
            utility_results: dict[int, UtilityResult] = {}
            while self.commands.poll(0):
                command: CoreCommand = pickle.loads(self.commands.recv(copy=False))
                self.num_commands_applied += 1
                if command.kind is CommandKind.SHUTDOWN:
                    return
                if command.kind is CommandKind.CHECK_IDLE:
                    self.pending_idle_checks.append(self.num_commands_applied)
                elif command.kind is CommandKind.UTILITY:
                    outputs.extend(self._settle_finished())
                    utility_results[self.num_commands_applied] = self._call_utility(command)
                else:
                    outputs.extend(self._apply(command))
            if self.core.has_work():
                outputs.extend(self.core.step())
                self.num_steps += 1
                if self.debug_check_idle and not self.core.has_work():
                    self.core.check_idle()  # a leak ends the core, loudly, with the check's message
            idle_checks: dict[int, str | None] = {}
            if self.pending_idle_checks and not self.core.has_work():
                idle_checks = dict.fromkeys(self.pending_idle_checks, self._idle_error())
                self.pending_idle_checks = []
            report = CoreReport(
                outputs=outputs,
                stats=self.core.scheduler.make_stats(),
                num_commands_applied=self.num_commands_applied,
                has_work=self.core.has_work(),
                idle_checks=idle_checks,
                num_steps=self.num_steps,
                utility_results=utility_results,
            )
            send(self.reports, report)

    def _apply(self, command: CoreCommand) -> list[EngineCoreOutput]:
        if command.kind is CommandKind.ADD:
            assert command.request is not None
            try:
                self.core.add_request(command.request)
            # The scheduler's own limits, or a sleeping engine: refuse this request, serve the rest.
            except (ValueError, EngineSleepingError) as error:
                return [EngineCoreOutput(command.request.request_id, [], FinishReason.ERROR, error=str(error))]
        elif command.kind is CommandKind.ABORT:
            self.core.abort_requests(command.request_ids)
        elif command.kind is CommandKind.FINISH:
            assert command.status is not None
            self.core.finish_requests(command.request_ids, command.status)
        return []

    def _settle_finished(self) -> list[EngineCoreOutput]:
        """Step while the only work left is requests already finished (aborted just before):
        no forward runs, and a sleep or weight update sent right after an abort finds the core idle."""
        outputs: list[EngineCoreOutput] = []
        while (
            self.core.has_work() and not self.core.scheduler.has_unfinished_requests() and not self.core.is_sleeping()
        ):
            outputs.extend(self.core.step())
            self.num_steps += 1
        return outputs

    def _call_utility(self, command: CoreCommand) -> UtilityResult:
        if command.method not in UTILITY_METHODS:
            return UtilityResult(error=ValueError(f"unknown engine core utility {command.method!r}"))
        try:
            return UtilityResult(value=getattr(self.core, command.method)(*command.args))
        except Exception as error:
            logger.info("engine core utility %s failed: %s", command.method, error)
            return UtilityResult(error=picklable(error))

    def _idle_error(self) -> str | None:
        try:
            self.core.check_idle()
        except AssertionError as error:
            return str(error) or "engine core idle check failed"
        return None


def picklable(error: Exception) -> Exception:
    """`error` itself when it survives pickling, else a RuntimeError with its type and message
    (an exception whose __init__ takes other arguments than its message does not)."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def inject_test_fault(core: EngineCore, fault: str, parent_pid: int) -> None:
    """For tests: make the N-th model forward of `fault` = "raise@N" raise, or of "hang@N"
    never return (until the parent process is gone)."""
    kind, _, count = fault.partition("@")
    if kind not in ("raise", "hang") or not count.isdigit():
        raise ValueError(f"{TEST_FAULT_ENV} must be 'raise@N' or 'hang@N', got {fault!r}")
    execute_model = core.executor.execute_model
    calls = 0

    def faulty_execute_model(scheduler_output):
        nonlocal calls
        calls += 1
        if calls == int(count):
            if kind == "raise":
                raise RuntimeError(f"injected model forward failure ({TEST_FAULT_ENV}={fault})")
            while os.getppid() == parent_pid:
                time.sleep(0.1)
        return execute_model(scheduler_output)

    core.executor.execute_model = faulty_execute_model


def run_engine_core(config: EngineConfig | Mapping[str, Any], ipc_dir: str, parent_pid: int) -> None:
    """The core process's entry point (started by `EngineCoreClient`): serve, remove the pipes'
    directory however serving ended (a parent killed outright cannot), then exit with the
    serving's status, without the interpreter's teardown (see `pagoda.process_exit`)."""
    # A forked core shares its parent's signal wake-up pipe, if the parent's event loop set one:
    # its signals would wake the parent's handlers.
    signal.set_wakeup_fd(-1)
    # Ctrl-C in a terminal reaches the whole process group; the server decides when this ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM (the client's fallback, multiprocessing's exit handler) unwinds through the cleanup.
    signal.signal(signal.SIGTERM, exit_on_signal)
    code = 0
    try:
        serve_engine_core(config, ipc_dir, parent_pid)
    except SystemExit as request:
        code = request.code if isinstance(request.code, int) else 1
    finally:
        shutil.rmtree(ipc_dir, ignore_errors=True)
    exit_process(code)


def exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # the shell's convention for "ended by signal signum"


def serve_engine_core(config: EngineConfig | Mapping[str, Any], ipc_dir: str, parent_pid: int) -> None:
    """Build the core (and first its config, when given `create_engine_config`'s keyword
    arguments), report ready, run the loop; a failure is reported as CoreFailed and exits 1."""
    # The engine is imported here, in the core process only: the client imports this module
    # for its sockets and this entry point, and starts the core before it imports the engine.
    from pagoda.engine.arg_utils import create_engine_config
    from pagoda.engine.core import EngineCore

    commands_address, reports_address = ipc_addresses(ipc_dir)
    context = zmq.Context()
    commands = open_socket(context, zmq.PULL, commands_address, bind=False)
    # Lingers so that a last CoreFailed still reaches the client after the socket closes.
    reports = open_socket(context, zmq.PUSH, reports_address, bind=False, linger_ms=5000)
    core = None
    try:
        core = EngineCore(config if isinstance(config, EngineConfig) else create_engine_config(**config))
        if os.environ.get(TEST_FAULT_ENV):
            inject_test_fault(core, os.environ[TEST_FAULT_ENV], parent_pid)
        freeze_startup_objects()
        send(reports, CoreReady(num_kv_blocks=core.scheduler.kv_cache_manager.block_pool.num_usable_blocks))
        EngineCoreLoop(core, commands, reports, parent_pid).run()
    except ConfigError as error:  # a bad argument, not a bug: the client's own config says the same
        logger.error("engine core: %s", error)
        send(reports, CoreFailed(str(error)))
        raise SystemExit(1) from None
    except Exception:
        logger.exception("engine core failed")
        send(reports, CoreFailed(traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if core is not None:
            core.shutdown()
        commands.close()
        reports.close()
        context.term()
