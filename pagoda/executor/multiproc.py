"""The multiprocess executor: one local worker process per rank (`worker_proc`), forked by
this process's rank launcher (`rank_launcher`) or started as a fresh interpreter.

Each step's `SchedulerOutput` is pickled once and the same bytes go down every rank's pipe
(a socket pair); every rank runs the forward, and only the driver rank (TP rank 0 of the
last pipeline stage) answers, through a sender thread, so `execute_model` returns at once
with a `FutureModelRunnerOutput` that the engine's batch queue resolves in order.

Any wait on a worker also watches every worker process: a rank that dies (or whose step
raised) fails the call within `WORKER_POLL_S` with `WorkerFailedError`, instead of the engine
hanging on a collective the dead rank will never join; `shutdown` then kills what is left.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import subprocess
import sys
import time
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Any

import pagoda
from pagoda.config import EngineConfig
from pagoda.distributed.parallel_state import free_port
from pagoda.engine.errors import WorkerFailedError
from pagoda.executor.abstract import Executor
from pagoda.executor.rank_launcher import LaunchedRank, RankLauncher, launcher_enabled
from pagoda.executor.worker_proc import WorkerCall, WorkerInit, WorkerReply, send
from pagoda.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from pagoda.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)

# How often a wait on a worker checks that every worker process still lives.
WORKER_POLL_S = 0.2
# The worker's entry point; imported (not run as __main__) so that its messages unpickle by module name.
WORKER_MAIN = "from pagoda.executor.worker_proc import main; main()"
# How long shutdown lets workers exit on their own before killing them.
SHUTDOWN_GRACE_S = 5.0


class FutureModelRunnerOutput(AsyncModelRunnerOutput):
    """A step's output still on its way from the driver rank; resolved in submission order."""

    def __init__(self, executor: MultiprocExecutor, step: int) -> None:
        self.executor = executor
        self.step = step

    def get_output(self) -> ModelRunnerOutput:
        return self.executor.step_output(self.step)


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        parallel = config.parallel_config
        self.world_size = parallel.world_size
        self.output_rank = parallel.driver_rank
        init_method = parallel.distributed_init_method or f"tcp://127.0.0.1:{free_port()}"
        self.processes: list[subprocess.Popen | LaunchedRank] = []
        self.connections: list[Connection] = []
        self._steps_sent = 0
        self._outputs: dict[int, ModelRunnerOutput] = {}
        self._steps_received = 0
        env = dict(os.environ)
        # The workers import pagoda from wherever this process did.
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(pagoda.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        launcher = RankLauncher.shared(env) if launcher_enabled(config.device_config.device) else None
        try:
            for rank in range(self.world_size):
                ours, theirs = Pipe(duplex=True)
                if launcher is not None:
                    self.processes.append(launcher.launch(theirs.fileno(), env))
                else:
                    command = [sys.executable, "-c", WORKER_MAIN, str(theirs.fileno()), str(os.getpid())]
                    self.processes.append(subprocess.Popen(command, env=env, pass_fds=[theirs.fileno()]))
                theirs.close()
                self.connections.append(ours)
                local_rank = rank  # one node: ranks are device indices
                send(
                    ours,
                    WorkerInit(
                        config, rank, local_rank, init_method, rank == self.output_rank, rank < self.output_rank
                    ),
                )
            for rank in range(self.world_size):
                self._recv(rank)  # loaded
        except BaseException:
            self.shutdown()
            raise
        logger.info("started %d worker processes (driver rank %d)", self.world_size, self.output_rank)

    def _broadcast(self, call: WorkerCall) -> None:
        if not self.connections:
            raise WorkerFailedError(f"{call.method}: the workers were shut down")
        data = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, connection in enumerate(self.connections):
            try:
                connection.send_bytes(data)
            except OSError as e:
                raise self._failure(f"cannot reach rank {rank}: {e}") from e

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        if self._steps_received != self._steps_sent:
            raise RuntimeError(f"collective_rpc({method!r}) while {self._steps_sent - self._steps_received} steps run")
        self._broadcast(WorkerCall(method, args))
        return [self._recv(rank) for rank in range(self.world_size)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        self._broadcast(WorkerCall("execute_model", (scheduler_output,)))
        self._steps_sent += 1
        return FutureModelRunnerOutput(self, self._steps_sent - 1)

    def step_output(self, step: int) -> ModelRunnerOutput:
        """The driver's output of `step`, receiving (in order) every earlier one still due."""
        while step not in self._outputs:
            self._outputs[self._steps_received] = self._recv(self.output_rank)
            self._steps_received += 1
        return self._outputs.pop(step)

    def _recv(self, rank: int) -> Any:
        """The next reply of `rank`, watching every worker while waiting."""
        connection = self.connections[rank]
        while not connection.poll(WORKER_POLL_S):
            self.check_health()
        reply = self._read(rank)
        if not reply.ok:
            self.check_health()  # a rank that died is the cause of its peers' collective errors
            raise self._failure(f"worker failed: {reply.value}")
        return reply.value

    def _read(self, rank: int) -> WorkerReply:
        try:
            return pickle.loads(self.connections[rank].recv_bytes())
        except (EOFError, OSError) as e:
            raise self._failure(f"rank {rank} closed its pipe (exit status {self.processes[rank].poll()})") from e

    def check_health(self) -> None:
        """Raise if any worker exited, with its last words when it left some."""
        for rank, process in enumerate(self.processes):
            status = process.poll()
            if status is None:
                continue
            connection = self.connections[rank]
            if connection.poll(0):
                reply = self._read(rank)
                if not reply.ok:
                    raise self._failure(f"worker failed: {reply.value}")
            raise self._failure(f"worker rank {rank} (pid {process.pid}) died with exit status {status}")

    def _failure(self, message: str) -> WorkerFailedError:
        logger.error("%s", message)
        return WorkerFailedError(message)

    def shutdown(self) -> None:
        """Ask every worker to exit, then kill those still running after a grace period."""
        for connection in self.connections:
            with contextlib.suppress(OSError):  # already gone
                send(connection, WorkerCall("shutdown", ()))
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for process in self.processes:
            try:
                process.wait(max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for connection in self.connections:
            connection.close()
        self.processes, self.connections = [], []
