"""`pagoda serve` flags, apart from the server so that the CLI parses them without importing
the server's dependencies."""

from __future__ import annotations

import argparse


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    group.add_argument("--served-model-name", default=None, help="model name for clients (default: file name)")
    group.add_argument(
        "--enable-debug-routes", action="store_true", help="add GET /debug/idle (the engine's idle check, for tests)"
    )
    group.add_argument("--uvicorn-log-level", default="warning")
