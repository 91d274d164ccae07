"""One rank of the multiprocess executor: a Worker in a process of its own, driven by messages.

`MultiprocExecutor` has it forked by the rank launcher (`rank_launcher`: a process that
imported the engine once and never touched CUDA), or starts it as `python -c "...worker_proc
import main; main()" FD PARENT_PID`, a fresh interpreter; never a fork of its own process
(which may hold CUDA) nor multiprocessing's spawn (which re-imports the user's main module). It
talks to the rank over one end of a socket pair (FD). Messages are pickled once each:
`WorkerInit`, then `WorkerCall`s; every call but `execute_model` is answered with a
`WorkerReply`, and `execute_model` only by the driver rank. The driver's step outputs go out
from a sender thread, which waits for the sampled ids to reach the host while the main thread
launches the next step.

A failed step replies with the traceback and exits 1 (the other ranks may be stuck in a
collective: the executor kills them). The process dies with its parent (PR_SET_PDEATHSIG).

With PAGODA_WORKER_PROFILE_DIR set, each rank profiles steps 11 to 60 (`StepProfile`) and
then writes `rank<N>.txt` there: time waiting for each step's message against time inside
the step, and torch.profiler's table of the kernels and host calls.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, NoReturn

from pagoda.config import EngineConfig
from pagoda.process_exit import exit_process, freeze_startup_objects

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
PROFILE_DIR_ENV = "PAGODA_WORKER_PROFILE_DIR"
# Steps a profiled rank skips (warm-up), then profiles.
PROFILE_SKIP_STEPS, PROFILE_STEPS = 10, 50


@dataclass
class WorkerInit:
    config: EngineConfig
    rank: int
    local_rank: int
    distributed_init_method: str | None
    is_driver_worker: bool
    return_hidden_states: bool


@dataclass
class WorkerCall:
    method: str  # a Worker method
    args: tuple[Any, ...]


@dataclass
class WorkerReply:
    ok: bool
    value: Any  # the result, or the traceback when not ok


@dataclass
class StepProfile:
    """Where one rank's step time goes: waiting for the message vs inside `execute_model`
    (host wall time), and torch.profiler over the same steps."""

    directory: str
    rank: int
    wait_s: list[float] = field(default_factory=list)
    execute_s: list[float] = field(default_factory=list)
    num_steps: int = 0
    profiler: Any = None

    def record(self, wait_s: float, execute_s: float) -> None:
        self.num_steps += 1
        if self.num_steps < PROFILE_SKIP_STEPS or self.num_steps > PROFILE_SKIP_STEPS + PROFILE_STEPS:
            return
        if self.num_steps == PROFILE_SKIP_STEPS + PROFILE_STEPS:
            self.write()
            return
        if self.profiler is None:
            import torch

            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()
            return  # this step starts the profiler; it is not counted
        self.wait_s.append(wait_s)
        self.execute_s.append(execute_s)

    def write(self) -> None:
        if self.profiler is None:
            return
        self.profiler.stop()
        steps = max(len(self.execute_s), 1)
        table = self.profiler.key_averages().table(sort_by="self_device_time_total", row_limit=40)
        with open(os.path.join(self.directory, f"rank{self.rank}.txt"), "w") as file:
            file.write(
                f"rank {self.rank}: {len(self.execute_s)} steps; per step: waiting for the message "
                f"{1000 * sum(self.wait_s) / steps:.3f} ms, inside execute_model "
                f"{1000 * sum(self.execute_s) / steps:.3f} ms (host wall time, profiler on)\n{table}\n"
            )


def send(connection: Connection, message: Any) -> None:
    connection.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the thread that started it exits (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        logger.warning("cannot ask to die with the parent process on this platform")
    if os.getppid() != parent_pid:
        os._exit(1)  # the parent died before prctl took effect


def _send_replies(connection: Connection, replies: queue.Queue) -> None:
    """Send replies in order; resolve step outputs here so the main thread never waits on them."""
    from pagoda.worker.async_output import AsyncGPUModelRunnerOutput

    while (reply := replies.get()) is not None:
        if isinstance(reply.value, AsyncGPUModelRunnerOutput):
            reply = WorkerReply(True, reply.value.host_output())
        send(connection, reply)


def run_worker(connection: Connection) -> int:
    """Serve calls until `shutdown` or the executor's end of the pipe closes; the exit status."""
    from pagoda.distributed.parallel_state import destroy_distributed_environment
    from pagoda.worker.worker import Worker

    init: WorkerInit = pickle.loads(connection.recv_bytes())
    replies: queue.Queue[WorkerReply | None] = queue.Queue()
    sender = threading.Thread(target=_send_replies, args=(connection, replies), daemon=True)
    sender.start()
    status = 0
    profile_dir = os.environ.get(PROFILE_DIR_ENV)
    profile = StepProfile(profile_dir, init.rank) if profile_dir else None
    try:
        worker = Worker(
            init.config,
            local_rank=init.local_rank,
            rank=init.rank,
            distributed_init_method=init.distributed_init_method,
            is_driver_worker=init.is_driver_worker,
            return_hidden_states=init.return_hidden_states,
        )
        worker.init_device()
        worker.load_model()
        freeze_startup_objects()
        replies.put(WorkerReply(True, None))
        while True:
            waited_from = time.perf_counter()
            try:
                call: WorkerCall = pickle.loads(connection.recv_bytes())
            except EOFError:
                break  # the executor is gone
            if call.method == "shutdown":
                break
            started = time.perf_counter()
            try:
                result = getattr(worker, call.method)(*call.args)
                if profile is not None and call.method == "execute_model":
                    profile.record(started - waited_from, time.perf_counter() - started)
            except Exception:
                replies.put(WorkerReply(False, f"rank {init.rank}: {traceback.format_exc()}"))
                if call.method == "execute_model":
                    status = 1  # the ranks' states may now differ: this worker cannot go on
                    break
                continue
            if call.method != "execute_model" or result is not None:
                replies.put(WorkerReply(True, result))
    except Exception:
        replies.put(WorkerReply(False, f"rank {init.rank}: {traceback.format_exc()}"))
        status = 1
    replies.put(None)
    sender.join()
    if status == 0:
        destroy_distributed_environment()
    return status


def serve_rank(fd: int, parent_pid: int) -> NoReturn:
    """Serve the executor's pipe `fd` as a rank that dies with process `parent_pid`, its parent
    (the executor's process, or the rank launcher that forked it)."""
    _die_with_parent(parent_pid)
    logging.basicConfig(level=os.environ.get("PAGODA_LOG_LEVEL", "WARNING"))
    exit_process(run_worker(Connection(fd)))  # no teardown: a rank stuck in a collective would hang it


def main() -> None:
    serve_rank(int(sys.argv[1]), int(sys.argv[2]))
