"""`pagoda router`'s flags (apart from the router, so the CLI starts without fastapi and httpx)."""

from __future__ import annotations

import argparse


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", required=True, metavar="URL", help="the producer: pagoda serve --kv-role producer")
    parser.add_argument("--decode", required=True, metavar="URL", help="the consumer: pagoda serve --kv-role consumer")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds either server may take to answer")
