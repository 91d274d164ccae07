"""The HTTP server under the app: uvicorn's configuration and its stop-signal handling."""

from __future__ import annotations

import argparse
import functools
import signal
from types import FrameType

import uvicorn
from fastapi import FastAPI

from pagoda.entrypoints.openai.http_protocol import ConnectionLimits, GuardedH11Protocol


class DrainingServer(uvicorn.Server):
    """uvicorn's server, where a stop signal starts a drain (`app.state.draining`) and ends in
    a normal exit: uvicorn itself re-raises the signal once done, which makes the exit code
    -SIGTERM instead of 0."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.app_state = app.state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting for requests in flight
        self.should_exit = True
        self.app_state.draining = True


def uvicorn_config(app: FastAPI, args: argparse.Namespace) -> uvicorn.Config:
    """uvicorn's settings from the `pagoda serve` flags. The protocol is pinned (h11, with the
    guards of http_protocol) rather than left to whichever parser happens to be installed."""
    limits = ConnectionLimits(args.max_connections, args.header_timeout, args.body_timeout)
    return uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        http=functools.partial(GuardedH11Protocol, limits=limits),  # type: ignore[arg-type]
        ws="none",
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
