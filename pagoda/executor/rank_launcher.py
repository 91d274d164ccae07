"""`RankLauncher`: rank processes forked from a launcher that imported the engine once.

A rank started as a fresh interpreter imports torch, transformers' config classes and the
engine before it reads its first message: ~6.8 s of CPU a rank on the 2-core CPU machine, paid
again by every engine a process builds (TP=2 x PP=2 pays it four times at once). The launcher
is one fresh interpreter per executor process, started with its first multiprocess executor on
the CPU, that imports those modules and then forks one rank per request. Forking it is safe where
forking the executor's process may not be: it has one thread and ran no torch op (an OpenMP
pool does not survive a fork). CUDA engines do without it (`launcher_enabled`).

Over a socket pair (one message a packet) the executor sends a rank's working directory and
environment with the rank's end of its pipe (SCM_RIGHTS); the launcher forks, the child serves
the rank (`worker_proc.serve_rank`) and the launcher answers ("started", pid). The rank is the
launcher's child, not the executor's: the launcher reaps it and reports ("exited", pid,
status), which is what `LaunchedRank.poll` reads. The launcher exits when the executor's
process is gone (its end of the socket closes, or its parent changes), and its ranks die with
it (PR_SET_PDEATHSIG). `PAGODA_RANK_LAUNCHER=0` starts each rank as a fresh interpreter instead.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import ClassVar

LAUNCHER_ENV = "PAGODA_RANK_LAUNCHER"
LAUNCHER_MAIN = "from pagoda.executor.rank_launcher import main; main()"
# The launcher's loop: how often it reaps its children and looks for its parent.
REAP_INTERVAL_S = 0.1
# How long a rank that ended waits for the launcher's report of its status (it reaps every
# REAP_INTERVAL_S).
REPORT_TIMEOUT_S = 5.0
# How long a launch waits for the launcher's answer (its first one follows its imports).
LAUNCH_TIMEOUT_S = 300.0
MAX_MESSAGE_BYTES = 1 << 20
# What a rank imports before it reads its first message; transformers' Llama config stands for
# what every model's config pulls in with it (activations, hub kernels, torch.distributed.tensor).
PRELOAD_MODULES = (
    "pagoda.executor.worker_proc",
    "pagoda.worker.worker",
    "pagoda.distributed.parallel_state",
    "pagoda.model.loader",
    "transformers.models.llama.configuration_llama",
)


def launcher_enabled(device: str) -> bool:
    """For CPU engines only: a CUDA engine's ranks start as fresh interpreters, since the
    launcher's imports might initialize the CUDA driver (`torch.cuda.is_available()` does,
    unseen by `torch.cuda.is_initialized()`), after which no forked child could use CUDA."""
    return (
        device == "cpu"
        and os.environ.get(LAUNCHER_ENV, "1") != "0"
        and hasattr(os, "fork")
        and hasattr(socket, "send_fds")
    )


class LaunchedRank:
    """A rank forked by the launcher, with `subprocess.Popen`'s `pid`, `poll`, `wait` and `kill`.

    A rank that died is seen at once through a pidfd (readable once the process ended), not
    only when the launcher's report arrives: the executor blames the rank that died, not its
    peers whose collectives failed an instant later."""

    def __init__(self, launcher: RankLauncher, pid: int) -> None:
        self.launcher = launcher
        self.pid = pid
        self._pidfd: int | None = None
        with contextlib.suppress(AttributeError, OSError):  # Linux 5.3+; else the reports alone
            self._pidfd = os.pidfd_open(pid)

    def poll(self) -> int | None:
        ended = self._pidfd is not None and bool(select.select([self._pidfd], [], [], 0)[0])
        return self._status(REPORT_TIMEOUT_S if ended else 0.0)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = REAP_INTERVAL_S if deadline is None else min(REAP_INTERVAL_S, deadline - time.monotonic())
            status = self._status(max(left, 0.0))
            if status is not None:
                return status
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout or 0.0)

    def _status(self, timeout_s: float) -> int | None:
        """The reported exit status (waiting up to `timeout_s`); the pidfd is closed once known."""
        status = self.launcher.exit_status(self.pid, timeout_s)
        if status is not None and self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        return status

    def kill(self) -> None:
        if self.poll() is None:  # not reaped yet, so the pid is still this rank's
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


class RankLauncher:
    """The executor's side: starts the launcher, asks it for ranks, and keeps their exit statuses."""

    _shared: ClassVar[RankLauncher | None] = None
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def shared(cls, env: dict[str, str]) -> RankLauncher:
        """This process's launcher (a new one after a fork, or once the last one died), started
        with `env`: that of the first executor that needs one."""
        with cls._shared_lock:
            launcher = cls._shared
            if launcher is None or launcher.owner_pid != os.getpid() or launcher.process.poll() is not None:
                cls._shared = launcher = cls(env)
            return launcher

    def __init__(self, env: dict[str, str]) -> None:
        self.owner_pid = os.getpid()
        self._socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            command = [sys.executable, "-c", LAUNCHER_MAIN, str(theirs.fileno()), str(os.getpid())]
            self.process = subprocess.Popen(command, env=env, pass_fds=[theirs.fileno()])
        self._lock = threading.Lock()
        self._exited: dict[int, int] = {}

    def launch(self, fd: int, env: dict[str, str]) -> LaunchedRank:
        """Fork a rank that serves the pipe end `fd` (kept open here: the caller closes it)."""
        with self._lock:
            request = pickle.dumps((os.getcwd(), env))
            try:
                socket.send_fds(self._socket, [request], [fd])
            except OSError as e:
                raise RuntimeError(f"the rank launcher (pid {self.process.pid}) is gone: {e}") from e
            deadline = time.monotonic() + LAUNCH_TIMEOUT_S
            while time.monotonic() < deadline:
                message = self._receive(REAP_INTERVAL_S)
                if message is not None and message[0] == "started":
                    return LaunchedRank(self, message[1])
                if message is None and self.process.poll() is not None:
                    raise RuntimeError(f"the rank launcher exited with status {self.process.returncode}")
            raise RuntimeError(f"the rank launcher did not fork a rank within {LAUNCH_TIMEOUT_S:g} s")

    def exit_status(self, pid: int, timeout_s: float) -> int | None:
        """Rank `pid`'s exit status once the launcher reported it, waiting up to `timeout_s`.
        Ranks die with their launcher: after it, one it never reported is taken as killed."""
        with self._lock:
            deadline = time.monotonic() + timeout_s
            while pid not in self._exited:
                if self._receive(max(deadline - time.monotonic(), 0.0)) is None:
                    if self.process.poll() is not None:
                        return self._exited.setdefault(pid, -signal.SIGKILL)
                    if time.monotonic() >= deadline:
                        return None
            return self._exited[pid]

    def _receive(self, timeout_s: float) -> tuple | None:
        """The launcher's next message within `timeout_s` (None if none came); exit reports are
        recorded on the way. Called with the lock held."""
        if not select.select([self._socket], [], [], timeout_s)[0]:
            return None
        data = self._socket.recv(MAX_MESSAGE_BYTES)
        if not data:  # the launcher is gone
            self.process.wait()
            return None
        message = pickle.loads(data)
        if message[0] == "exited":
            self._exited[message[1]] = message[2]
        return message


def main() -> None:
    """The launcher process: import what ranks need, then fork one per request until the
    executor's process is gone."""
    import importlib

    fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    control = socket.socket(fileno=fd)
    for name in PRELOAD_MODULES:
        importlib.import_module(name)
    from pagoda.executor.worker_proc import serve_rank

    children: set[int] = set()
    while os.getppid() == parent_pid:
        for pid, status in _reap(children):
            control.send(pickle.dumps(("exited", pid, status)))
        if not select.select([control], [], [], REAP_INTERVAL_S)[0]:
            continue
        data, fds, _, _ = socket.recv_fds(control, MAX_MESSAGE_BYTES, 1)
        if not data:
            break  # the executor's process closed its end
        cwd, env = pickle.loads(data)
        launcher_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            try:
                control.close()
                os.chdir(cwd)
                os.environ.clear()
                os.environ.update(env)
                serve_rank(fds[0], launcher_pid)
            finally:
                os._exit(1)  # serve_rank exits itself; this only if it raised before
        os.close(fds[0])
        children.add(pid)
        control.send(pickle.dumps(("started", pid)))
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os._exit(0)


def _reap(children: set[int]) -> list[tuple[int, int]]:
    """(pid, exit status) of the children that ended, reaped."""
    ended = []
    for pid in list(children):
        reaped, status = os.waitpid(pid, os.WNOHANG)
        if reaped:
            children.discard(pid)
            ended.append((pid, os.waitstatus_to_exitcode(status)))
    return ended
