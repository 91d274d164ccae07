"""Entrypoints tests: the OpenAI-compatible server, each module against one real `pagoda serve`
(the default model, SmolLM2, in float32 on the CPU) in a subprocess, driven over HTTP: the API
and its errors, limits, security, fuzzing, load, faults, sleep mode and graceful shutdown; and
the streaming plumbing the endpoints share, without a server."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator

import pytest
from server_utils import MODEL, RemoteServer

# Every server here runs on the CPU, in float32.
CPU_FLOAT32 = ("--dtype", "float32", "--device", "cpu")


def _stop(server: RemoteServer, exit_codes: tuple[int, ...] | None, may_exit_first: bool) -> None:
    if may_exit_first and server.process.poll() is not None:
        return  # a test ended it (and checked how)
    code = server.stop()  # SIGTERM; fails if a child process is left behind
    if exit_codes is not None:
        assert code in exit_codes, f"the server exited with {code}, not one of {exit_codes}"


@pytest.fixture(scope="session")
def tiny_model_args(tiny_checkpoint: str) -> tuple[str, ...]:
    """`pagoda serve` arguments for `tiny_checkpoint`, served under SmolLM2's name."""
    return ("--model", tiny_checkpoint, "--served-model-name", MODEL)


@pytest.fixture(scope="module")
def start_server() -> Iterator[Callable[..., RemoteServer]]:
    """Starts `pagoda serve` in float32 on the CPU, then `serve_args`, and stops every server
    it started at the end of the module (RemoteServer.stop: SIGTERM, no process left behind),
    each checked to exit with one of `exit_codes` (None: any code):

        start_server(*serve_args, api_key=None, env=None, exit_codes=(0,), may_exit_first=False)

    `env` is set for the server's start only (its processes inherit it). With `may_exit_first`,
    the module's tests may end the server themselves (a killed core, an injected fault): it is
    stopped only if still running."""
    with contextlib.ExitStack() as stops:  # every server is stopped even if stopping one fails

        def start(
            *serve_args: str,
            api_key: str | None = None,
            env: dict[str, str] | None = None,
            exit_codes: tuple[int, ...] | None = (0,),
            may_exit_first: bool = False,
        ) -> RemoteServer:
            with pytest.MonkeyPatch.context() as patch:
                for name, value in (env or {}).items():
                    patch.setenv(name, value)
                server = RemoteServer(*CPU_FLOAT32, *serve_args, api_key=api_key)
            stops.callback(_stop, server, exit_codes, may_exit_first)
            return server

        yield start


@pytest.fixture(scope="session")
def shared_server() -> Iterator[Callable[..., RemoteServer]]:
    """One `pagoda serve` per distinct (serve_args, api_key) for the whole session, stopped at
    its end (exit code 0, or -SIGTERM when uvicorn re-raised it):

        shared_server(*serve_args, api_key=None)

    For modules whose tests leave the server as they found it: no fault, shutdown or sleep;
    counters compared as differences, the engine idle after each test."""
    servers: dict[tuple[tuple[str, ...], str | None], RemoteServer] = {}
    with contextlib.ExitStack() as stops:

        def get(*serve_args: str, api_key: str | None = None) -> RemoteServer:
            key = (serve_args, api_key)
            if key not in servers:
                servers[key] = RemoteServer(*CPU_FLOAT32, *serve_args, api_key=api_key)
                stops.callback(_stop, servers[key], (0, -signal.SIGTERM), False)
            return servers[key]

        yield get
