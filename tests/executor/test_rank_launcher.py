"""The rank launcher (`pagoda.executor.rank_launcher`): ranks forked from one preloaded process
per executor process, reused by the engines it builds, with their exit statuses reported; the
same tokens as ranks started as fresh interpreters (`PAGODA_RANK_LAUNCHER=0`); and nothing left
behind when the process that owns the launcher is killed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest
from model_utils import save_tiny_checkpoint
from parallel_utils import ENGINE, FAILURE_DEADLINE_S, greedy, make_prompts
from server_utils import child_pids, is_running, wait_until

from pagoda.executor.rank_launcher import LAUNCHER_ENV, LaunchedRank, RankLauncher


def open_pidfds() -> int:
    """This process's open pidfds (each rank holds one until its exit status is known)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own, closed since
            count += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
    return count


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny"))
    save_tiny_checkpoint("llama3", path)
    return path


def test_engines_share_the_launcher_and_match_fresh_interpreters(start_llm, checkpoint, monkeypatch) -> None:
    """Two engines in turn get their ranks from one launcher (forked: the launcher's children);
    a clean shutdown reports status 0; fresh interpreters give the same tokens."""
    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    prompts = make_prompts()
    launchers, outputs = [], []
    pidfds = open_pidfds()
    for _ in range(2):
        llm = start_llm(checkpoint, tensor_parallel_size=2, **ENGINE)
        ranks = llm.llm_engine.engine_core.executor.processes
        assert all(isinstance(rank, LaunchedRank) for rank in ranks)
        launcher = ranks[0].launcher
        assert sorted(child_pids(launcher.process.pid)) == sorted(rank.pid for rank in ranks)
        outputs.append(greedy(llm, prompts))
        llm.shutdown()
        assert [rank.poll() for rank in ranks] == [0, 0]
        launchers.append(launcher)
    assert launchers[0] is launchers[1] and launchers[0].process.poll() is None
    assert open_pidfds() == pidfds, "a rank's pidfd outlived its engine"
    monkeypatch.setenv(LAUNCHER_ENV, "0")
    llm = start_llm(checkpoint, tensor_parallel_size=2, **ENGINE)
    assert all(isinstance(rank, subprocess.Popen) for rank in llm.llm_engine.engine_core.executor.processes)
    assert greedy(llm, prompts) == outputs[0] == outputs[1]


def test_a_killed_rank_reports_its_signal_at_once(start_llm, checkpoint, monkeypatch) -> None:
    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    llm = start_llm(checkpoint, tensor_parallel_size=2, **ENGINE)
    ranks = llm.llm_engine.engine_core.executor.processes
    ranks[1].kill()
    assert wait_until(lambda: ranks[1].poll() is not None, FAILURE_DEADLINE_S)
    assert ranks[1].poll() == -signal.SIGKILL and ranks[0].poll() is None


def test_nothing_outlives_the_launchers_owner(checkpoint) -> None:
    """The process that owns the launcher killed outright: the launcher and its ranks end."""
    script = (
        "import signal\n"
        "from pagoda import LLM\n"
        f"llm = LLM({checkpoint!r}, tensor_parallel_size=2, **{ENGINE!r})\n"
        "ranks = llm.llm_engine.engine_core.executor.processes\n"
        "print(ranks[0].launcher.process.pid, *(rank.pid for rank in ranks), flush=True)\n"
        "signal.pause()\n"
    )
    env = {key: value for key, value in os.environ.items() if key != LAUNCHER_ENV}
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(pid) for pid in owner.stdout.readline().split()]
        assert len(pids) == 3 and all(is_running(pid) for pid in pids)
        owner.kill()
        owner.wait(FAILURE_DEADLINE_S)
        assert wait_until(lambda: not any(is_running(pid) for pid in pids), FAILURE_DEADLINE_S)
    finally:
        owner.kill()
        owner.wait(FAILURE_DEADLINE_S)


def test_a_dead_launcher_is_replaced(checkpoint, start_llm, monkeypatch) -> None:
    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    first = RankLauncher.shared(dict(os.environ))
    first.process.kill()
    first.process.wait()
    llm = start_llm(checkpoint, tensor_parallel_size=2, **ENGINE)
    launcher = llm.llm_engine.engine_core.executor.processes[0].launcher
    assert launcher is not first and launcher.process.poll() is None
