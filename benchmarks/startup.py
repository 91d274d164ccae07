"""Time `pagoda serve` from launch to its first `/health` 200, for one or more checkouts, in
alternating rounds (a shared machine's load swings between runs: compare within a round).

    python benchmarks/startup.py --rounds 3 CHECKOUT [CHECKOUT ...] -- --dtype float32 --device cpu

Each checkout is a directory holding a `pagoda` package (a `git worktree` or `git archive` of
a commit); the arguments after `--` go to `pagoda serve`. Prints one row per round and the
medians last.
"""

from __future__ import annotations

import argparse
import os
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


def time_to_healthy(checkout: str, serve_args: list[str]) -> float:
    port = free_port()
    command = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", "--port", str(port), *serve_args]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(checkout)}
    start = time.monotonic()
    server = subprocess.Popen(command, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
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
    finally:
        server.terminate()
        server.wait(60)


def main() -> None:
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("checkouts", nargs="+")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    times: dict[str, list[float]] = {checkout: [] for checkout in args.checkouts}
    for number in range(1, args.rounds + 1):
        row = []
        for checkout in args.checkouts:
            times[checkout].append(time_to_healthy(checkout, serve_args))
            row.append(f"{checkout}: {times[checkout][-1]:.2f} s")
        print(f"round {number}: " + ", ".join(row), flush=True)
    print("| checkout | ready, s (each round) | median s |")
    print("|---|---|---|")
    for checkout, seconds in times.items():
        print(f"| {checkout} | {', '.join(f'{s:.2f}' for s in seconds)} | {statistics.median(seconds):.2f} |")


if __name__ == "__main__":
    main()
