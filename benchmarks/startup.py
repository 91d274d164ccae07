"""Time `pagoda serve` from launch to its first `/health` 200, and from SIGTERM (once healthy)
to its exit, for one or more checkouts, in alternating rounds (a shared machine's load swings
between runs: compare within a round), with the CPU seconds its processes used from launch to
exit (the server's and the engine core's it waited for: less sensitive to the load).

    python benchmarks/startup.py --rounds 3 CHECKOUT [CHECKOUT ...] -- --dtype float32 --device cpu

Each checkout is a directory holding a `pagoda` package (a `git worktree` or `git archive` of
a commit); the arguments after `--` go to `pagoda serve`. Prints one row per round and the
medians last.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

POLL_S = 0.05
TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_start_and_stop(checkout: str, serve_args: list[str]) -> tuple[float, float, float]:
    """(seconds from launch to healthy, seconds from SIGTERM to the process's exit, CPU seconds)."""
    port = free_port()
    command = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", "--port", str(port), *serve_args]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(checkout)}
    cpu = children_cpu_s()
    start = time.monotonic()
    server = subprocess.Popen(command, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ready = wait_healthy(server, port, start, checkout)
        stop = time.monotonic()
        server.terminate()
        server.wait(TIMEOUT_S)
        return ready, time.monotonic() - stop, children_cpu_s() - cpu
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(60)


def wait_healthy(server: subprocess.Popen, port: int, start: float, checkout: str) -> float:
    while time.monotonic() - start < TIMEOUT_S:
        if server.poll() is not None:
            raise RuntimeError(f"{checkout}: the server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as answer:
                if answer.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(POLL_S)
    raise TimeoutError(f"{checkout}: not healthy within {TIMEOUT_S:g} s")


def main() -> None:
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("checkouts", nargs="+")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    starts: dict[str, list[float]] = {checkout: [] for checkout in args.checkouts}
    stops: dict[str, list[float]] = {checkout: [] for checkout in args.checkouts}
    cpus: dict[str, list[float]] = {checkout: [] for checkout in args.checkouts}
    for number in range(1, args.rounds + 1):
        row = []
        for checkout in args.checkouts:
            ready, stopped, cpu = time_start_and_stop(checkout, serve_args)
            starts[checkout].append(ready)
            stops[checkout].append(stopped)
            cpus[checkout].append(cpu)
            row.append(f"{checkout}: ready {ready:.2f} s, stopped {stopped:.2f} s, CPU {cpu:.2f} s")
        print(f"round {number}: " + ", ".join(row), flush=True)
    print("| checkout | ready, s (each round) | median s | stop, s (each round) | median s | CPU s median |")
    print("|---|---|---|---|---|---|")
    for checkout in args.checkouts:
        ready, stopped = starts[checkout], stops[checkout]
        print(
            f"| {checkout} | {', '.join(f'{s:.2f}' for s in ready)} | {statistics.median(ready):.2f} "
            f"| {', '.join(f'{s:.2f}' for s in stopped)} | {statistics.median(stopped):.2f} "
            f"| {statistics.median(cpus[checkout]):.2f} |"
        )


if __name__ == "__main__":
    main()
