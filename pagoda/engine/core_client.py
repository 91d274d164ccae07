"""`EngineCoreClient`: EngineCore's interface, served by a core running in its own process.

`LLMEngine(config, engine_core=EngineCoreClient(config))` works as with the in-process core:
commands are sent without waiting, and `step()` returns the outputs reported since the last
call. A synchronous caller blocks in `step()` until the next report; an asyncio caller awaits
`wait_for_reports()` first, so `step()` finds them there and never blocks the event loop.

Utility calls (`sleep`, `wake_up`, `is_sleeping`, `update_weights`) run in the core between
steps; the synchronous methods block until the answer (reading reports meanwhile, so no output
is lost) and raise what the core raised. An asyncio caller sends with `send_utility()` and
finds the answer in `utility_results` once its output loop has read it.

Given `create_engine_config`'s keyword arguments instead of a config, the core builds the
config itself: a caller can start the core first and build its own copy (the same arguments
give the same config) while the core imports the engine and loads the model, as `pagoda serve`
does.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import Any

import zmq
import zmq.asyncio

from pagoda.config import EngineConfig
from pagoda.engine.core_messages import CommandKind, CoreCommand, CoreFailed, CoreReady, CoreReport, UtilityResult
from pagoda.engine.core_proc import ipc_addresses, open_socket, run_engine_core, send
from pagoda.engine.core_request import EngineCoreRequest
from pagoda.engine.errors import EngineDeadError
from pagoda.outputs import EngineCoreOutput, RequestStatus, SchedulerStats

logger = logging.getLogger(__name__)

# Between two looks at whether the core process still lives, while waiting for it.
LIVENESS_POLL_MS = 200
# How long a blocking utility call waits for the core's answer (a level-2 wake_up reloads weights).
DEFAULT_UTILITY_TIMEOUT_S = 600.0


def core_start_method(device: str | None) -> str:
    """How the core process of an engine on `device` starts: forked where that is safe, so that
    it begins with what this process has imported (torch and transformers cost a spawned core
    ~5 s of CPU on two cores before it reads its first argument); spawned elsewhere. A fork is
    safe for a CPU engine (`device` "cpu") from a process with no other thread (a lock another
    thread holds would stay held in the copy). A CUDA engine's core is always spawned: once this
    process initialized the CUDA driver (`torch.cuda.is_available()` does, as building the config
    does, unseen by `torch.cuda.is_initialized()`) a forked child cannot use CUDA.
    `PAGODA_CORE_START_METHOD` (fork or spawn) overrides."""
    chosen = os.environ.get("PAGODA_CORE_START_METHOD")
    if chosen is not None:
        if chosen not in ("fork", "spawn"):
            raise ValueError(f"PAGODA_CORE_START_METHOD must be fork or spawn, not {chosen!r}")
        return chosen
    safe = device == "cpu" and "fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1
    return "fork" if safe else "spawn"


class EngineCoreClient:
    def __init__(self, config: EngineConfig | Mapping[str, Any], startup_timeout_s: float = 900.0) -> None:
        # Mode 0700: only this user reaches the sockets. The core removes it too when it ends.
        self.ipc_dir = tempfile.mkdtemp(prefix="pagoda-core-")
        device = config.device_config.device if isinstance(config, EngineConfig) else config.get("device")
        self.start_method = core_start_method(device)
        logger.debug("engine core: starting it by %s", self.start_method)
        self.process = multiprocessing.get_context(self.start_method).Process(
            target=run_engine_core,
            args=(config if isinstance(config, EngineConfig) else dict(config), self.ipc_dir, os.getpid()),
            name="pagoda-engine-core",
            daemon=True,  # also ended by multiprocessing's exit handler if shutdown() is never called
        )
        self.num_commands_sent = 0
        self.num_commands_applied = 0
        self.stats: SchedulerStats | None = None
        # Why the core refused a request, by request id (its output finished with ERROR).
        self.request_errors: dict[str, str] = {}
        self.idle_check_answers: dict[int, str | None] = {}
        self.utility_results: dict[int, UtilityResult] = {}
        # Utility calls sent and not answered yet (a timed-out one leaves it: its answer is dropped).
        self._utility_waiting: set[int] = set()
        self.dead_error: EngineDeadError | None = None
        self._core_has_work = False
        # Heartbeat: steps the core has completed, and when the client last saw it move on
        # (a report with more steps, or work arriving at an idle core).
        self.num_core_steps = 0
        self._last_progress_time = time.monotonic()
        self._outputs: list[EngineCoreOutput] = []
        self._closed = False
        self._startup_deadline = time.monotonic() + startup_timeout_s
        self.num_kv_blocks: int | None = None  # known once the core is ready
        # Started before this process has threads or sockets of zmq's, which a fork would copy
        # (the core connects to addresses bound here afterwards: zmq retries until they are).
        self.process.start()
        self._context = zmq.Context()
        commands_address, reports_address = ipc_addresses(self.ipc_dir)
        self._commands = open_socket(self._context, zmq.PUSH, commands_address, bind=True)
        self._reports = open_socket(self._context, zmq.PULL, reports_address, bind=True)
        self._async_reports: zmq.asyncio.Socket | None = None

    # ---- EngineCore's interface ----------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(CoreCommand(CommandKind.ADD, request=request))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send(CoreCommand(CommandKind.ABORT, request_ids=list(request_ids)))

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        self._send(CoreCommand(CommandKind.FINISH, request_ids=list(request_ids), status=status))

    def has_work(self) -> bool:
        """True while the core has not applied every command sent, or reported work left."""
        return bool(self._outputs) or self.num_commands_applied < self.num_commands_sent or self._core_has_work

    def step(self) -> list[EngineCoreOutput]:
        """The outputs reported since the last call; waits for a report only when no report
        has arrived and the core still has work (never, after `wait_for_reports()`)."""
        self.wait_until_ready()
        if not self._receive(block=False) and not self._outputs and self.has_work():
            self._receive(block=True)
        outputs, self._outputs = self._outputs, []
        return outputs

    def check_idle(self, timeout_s: float = 10.0) -> None:
        """Raise AssertionError unless the core holds no request state and its KV pool is whole.

        The core answers once it has no work left (a finished request still to report or a
        batch in flight takes a step or two); one still busy after `timeout_s` fails the check."""
        number = self.send_idle_check()
        deadline = time.monotonic() + timeout_s
        while number not in self.idle_check_answers:
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine core still has work after {timeout_s:.0f} s")
            if self._reports.poll(LIVENESS_POLL_MS):
                self._receive(block=False)
            else:
                self._check_alive()
        error = self.idle_check_answers.pop(number)
        if error is not None:
            raise AssertionError(error)

    def sleep(self, level: int = 1) -> None:
        self.call_utility("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.call_utility("wake_up", tags)

    def is_sleeping(self) -> bool:
        return self.call_utility("is_sleeping")

    def update_weights(self, path: str) -> None:
        self.call_utility("update_weights", path)

    def call_utility(self, method: str, *args: Any, timeout_s: float = DEFAULT_UTILITY_TIMEOUT_S) -> Any:
        """Run `method(*args)` in the core between its steps and return what it returned, or
        raise what it raised; TimeoutError after `timeout_s` without an answer."""
        number = self.send_utility(method, *args)
        deadline = time.monotonic() + timeout_s
        while number not in self.utility_results:
            if time.monotonic() > deadline:
                self.abandon_utility(number)
                raise TimeoutError(f"the engine core did not answer {method} within {timeout_s:g} s")
            self._receive(block=True)
        return self.take_utility_result(number)

    def send_utility(self, method: str, *args: Any) -> int:
        """Send a utility call; its answer lands in `utility_results[number]`."""
        self._send(CoreCommand(CommandKind.UTILITY, method=method, args=args))
        self._utility_waiting.add(self.num_commands_sent)
        return self.num_commands_sent

    def take_utility_result(self, number: int) -> Any:
        """The value of answered call `number`, or raise its error."""
        result = self.utility_results.pop(number)
        if result.error is not None:
            raise result.error
        return result.value

    def abandon_utility(self, number: int) -> None:
        """The caller stopped waiting for call `number`: drop its answer when it comes."""
        self._utility_waiting.discard(number)
        self.utility_results.pop(number, None)

    def shutdown(self) -> None:
        """Stop the core process (politely, then by force) and release the sockets; idempotent."""
        if self._closed:
            return
        self._closed = True
        # A core still starting reads no command until its model is loaded: only a ready one
        # is asked; one still starting, or still alive after the ask, gets SIGTERM.
        if self.process.is_alive() and self.num_kv_blocks is not None:
            with contextlib.suppress(zmq.Again):
                send(self._commands, CoreCommand(CommandKind.SHUTDOWN), zmq.NOBLOCK)
            self.process.join(10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._async_reports = None  # a shadow of _reports: closing that one closes both
        self._commands.close()
        self._reports.close()
        self._context.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    # ---- for an asyncio owner ------------------------------------------------------------

    async def wait_for_reports(self) -> None:
        """Return once a report is waiting to be read; raise EngineDeadError if the core dies."""
        self.wait_until_ready()
        if self._async_reports is None:
            self._async_reports = zmq.asyncio.Socket.from_socket(self._reports)
        while not await self._async_reports.poll(LIVENESS_POLL_MS, zmq.POLLIN):
            self._check_alive()

    def seconds_without_progress(self) -> float:
        """How long the core has had work without completing a step; 0 while it has none, and
        while a utility call runs (a wake_up may reload the weights; its caller has a timeout)."""
        if not self.has_work() or self._utility_waiting:
            return 0.0
        return time.monotonic() - self._last_progress_time

    def send_idle_check(self) -> int:
        """Ask the core for its idle check; the answer lands in `idle_check_answers[number]`."""
        self._send(CoreCommand(CommandKind.CHECK_IDLE))
        return self.num_commands_sent

    def check_alive(self) -> None:
        """Raise EngineDeadError if the core has died (reads no report: safe from any caller)."""
        if self.dead_error is not None:
            raise self.dead_error
        if self._closed or not self.process.is_alive():
            raise EngineDeadError(f"the engine core process exited (exit code {self.process.exitcode})")

    # ---- internals -----------------------------------------------------------------------

    def _send(self, command: CoreCommand) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        self.wait_until_ready()
        if not self.has_work():
            self._last_progress_time = time.monotonic()  # an idle core has made no progress to wait for
        try:
            send(self._commands, command, zmq.NOBLOCK)
        except zmq.Again:  # no core at the other end: a PUSH socket would wait for one forever
            self._check_alive()
            self._die("the engine core process is not connected")
        self.num_commands_sent += 1

    def _receive(self, block: bool) -> int:
        """Read every report waiting (with `block`, first wait for one); returns how many."""
        if block:
            while not self._reports.poll(LIVENESS_POLL_MS):
                self._check_alive()
        count = 0
        while self._reports.poll(0):
            self._handle(pickle.loads(self._reports.recv(copy=False)))
            count += 1
        return count

    def _handle(self, message: CoreReport | CoreFailed | CoreReady) -> None:
        if isinstance(message, CoreFailed):
            self._die(f"the engine core failed:\n{message.error}")
        assert isinstance(message, CoreReport), f"unexpected message from the engine core: {message!r}"
        for output in message.outputs:
            if output.error is not None:
                self.request_errors[output.req_id] = output.error
        self._outputs.extend(message.outputs)
        if message.num_steps > self.num_core_steps:
            self.num_core_steps = message.num_steps
            self._last_progress_time = time.monotonic()
        self.stats = message.stats
        self.num_commands_applied = message.num_commands_applied
        self._core_has_work = message.has_work
        self.idle_check_answers.update(message.idle_checks)
        for number, result in message.utility_results.items():
            if number in self._utility_waiting:
                self._utility_waiting.remove(number)
                self.utility_results[number] = result
                self._last_progress_time = time.monotonic()  # the stall clock restarts after the call

    def _check_alive(self) -> None:
        """`check_alive` while waiting for reports: a death becomes final here."""
        try:
            self.check_alive()
        except EngineDeadError as error:
            if self.dead_error is None and self.num_kv_blocks is not None:
                self._receive(block=False)  # a CoreFailed sent just before the exit says why
            if self.dead_error is None:
                self._die(str(error))
            raise

    def _die(self, reason: str) -> None:
        logger.error(reason)
        self.dead_error = EngineDeadError(reason)
        raise self.dead_error

    def wait_until_ready(self) -> None:
        """Wait for the core to have built its model and KV cache (the first command waits for
        it anyway: call it to overlap other start-up work and see start-up errors early)."""
        if self.num_kv_blocks is not None:
            return
        try:
            while not self._reports.poll(LIVENESS_POLL_MS):
                self._check_alive()
                if time.monotonic() > self._startup_deadline:
                    raise TimeoutError("the engine core did not start in time")
            message = pickle.loads(self._reports.recv())
            if isinstance(message, CoreFailed):
                self._die(f"the engine core failed to start:\n{message.error}")
            assert isinstance(message, CoreReady), f"unexpected first message from the engine core: {message!r}"
        except BaseException:
            self.shutdown()
            raise
        self.num_kv_blocks = message.num_kv_blocks
