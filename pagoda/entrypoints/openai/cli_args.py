"""`pagoda serve` flags, apart from the server so that the CLI parses them without importing
the server's dependencies."""

from __future__ import annotations

import argparse
import socket
from dataclasses import dataclass

from pagoda.config import ConfigError
from pagoda.entrypoints.openai.reasoning import REASONING_PARSERS
from pagoda.entrypoints.openai.tool_parsers import TOOL_PARSERS

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_MAX_NUM_QUEUED_REQUESTS = 4096
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
# Far below a typical file-descriptor limit, far above one host's need of connections that each
# carry one request at a time (HTTP/1.1).
DEFAULT_MAX_CONNECTIONS = 1024
# A header is a few hundred bytes: seconds are generous on any network.
DEFAULT_HEADER_TIMEOUT_S = 10.0
# The largest body (--max-request-body-bytes, 32 MiB) in this time needs about 0.5 MiB/s.
DEFAULT_BODY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ServerOptions:
    """What the app does beyond serving the model, as `pagoda serve`'s flags set it."""

    api_key: str | None = None
    enable_debug_routes: bool = False
    trust_request_chat_template: bool = False
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    enable_weight_updates: bool = False
    # Refuse request fields the server does not know (400) instead of ignoring and logging them.
    strict_request_fields: bool = False
    # Serve the chat page at GET /.
    enable_ui: bool = True
    # Parsers of chat answers by name (tool_parsers/, reasoning/); None: the model's default / none.
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # LoRA adapters served from the start, (name, path); and whether clients may load more.
    lora_modules: tuple[tuple[str, str], ...] = ()
    enable_lora_updates: bool = False
    # Hosts chat's http(s) image URLs may name (a vision-language model); none: only data: URLs.
    allowed_media_domains: tuple[str, ...] = ()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerOptions:
        return cls(
            api_key=args.api_key,
            enable_debug_routes=args.enable_debug_routes,
            trust_request_chat_template=args.trust_request_chat_template,
            max_request_body_bytes=args.max_request_body_bytes,
            enable_weight_updates=args.enable_weight_updates,
            strict_request_fields=args.strict_request_fields,
            enable_ui=not args.no_ui,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            lora_modules=tuple(parse_lora_modules(args.lora_modules or [])),
            enable_lora_updates=args.enable_lora_updates,
            allowed_media_domains=tuple(args.allowed_media_domains or ()),
        )


def parse_lora_modules(values: list[str]) -> list[tuple[str, str]]:
    """`name=path` items of --lora-modules as (name, path); ValueError naming a malformed one."""
    modules = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules items are name=path, got {value!r}")
        modules.append((name, path))
    return modules


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The serve flags by topic: where it listens, what one client may cost, what it offers.
    Defaults are shown by the CLI's help formatter."""
    _add_listen_args(parser.add_argument_group("server"))
    _add_limit_args(parser.add_argument_group("limits"))
    _add_feature_args(parser.add_argument_group("features"))


def _add_listen_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    group.add_argument("--port", type=int, default=8000, help="TCP port, 1-65535")
    group.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    group.add_argument("--served-model-name", default=None, help="model name for clients (default: file name)")
    group.add_argument("--uvicorn-log-level", default="warning", help="uvicorn's own log level")


def _add_limit_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--max-num-queued-requests",
        type=_positive_int,
        default=DEFAULT_MAX_NUM_QUEUED_REQUESTS,
        help="requests (each of n samples counts) that may wait for the batch; more get 503 at once",
    )
    group.add_argument(
        "--max-request-body-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger request bodies get 413",
    )
    group.add_argument(
        "--max-connections",
        type=_positive_int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="open connections beyond this are answered 503 and closed at once",
    )
    group.add_argument(
        "--header-timeout",
        type=_positive_float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="seconds a client has to send a request's header, from the connection's opening or the "
        "previous response's end; then the connection is closed",
    )
    group.add_argument(
        "--body-timeout",
        type=_positive_float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds a client has to send a request's body once its header is in; then 408 and the "
        "connection is closed. Responses are never timed",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=_non_negative_float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="seconds requests in flight may run on after SIGTERM before they are cancelled",
    )


def _add_feature_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        metavar="HOST",
        help="hosts a chat image_url may be fetched from (exact names); by default remote image URLs are "
        "refused and only data: URLs are read",
    )
    group.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept chat_template and chat_template_kwargs in requests (rendered in a Jinja sandbox, "
        "but a template can still cost the server much time)",
    )
    group.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help="allow POST /sleep and /wake_up (weights and KV cache in memory the engine can release)",
    )
    group.add_argument(
        "--enable-weight-updates",
        action="store_true",
        help="allow POST /update_weights, which loads a checkpoint from any path the server can read",
    )
    group.add_argument(
        "--strict-request-fields",
        action="store_true",
        help="refuse request fields the server does not know with a 400 (default: ignore them, "
        "name them in the log and count them in the x-pagoda-ignored-fields header)",
    )
    group.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="how tool calls are read from chat answers with tool_choice 'auto' (default: from the chat "
        "template: mistral where it has [TOOL_CALLS], llama3_json where it has <|python_tag|>, else hermes)",
    )
    group.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="split <think>...</think> reasoning from chat answers into reasoning_content (default: none)",
    )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        metavar="NAME=PATH",
        default=None,
        help="LoRA adapters (PEFT directories) served as model NAME (needs --enable-lora)",
    )
    group.add_argument(
        "--enable-lora-updates",
        action="store_true",
        help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (loading reads any path the server can)",
    )
    group.add_argument("--no-ui", action="store_true", help="do not serve the chat page at GET /")
    group.add_argument(
        "--enable-debug-routes", action="store_true", help="add GET /debug/idle (the engine's idle check, for tests)"
    )


def check_serve_args(args: argparse.Namespace) -> None:
    """What can fail without the model, checked before it loads: one model given, a valid port
    that is free on the host. ConfigError (the CLI's exit code 2) otherwise."""
    if args.model_tag is not None and args.model is not None:
        raise ConfigError(f"model given twice ({args.model_tag!r} and --model {args.model!r}): give one")
    if args.model_tag is not None:
        args.model = args.model_tag
    try:
        parse_lora_modules(args.lora_modules or [])
    except ValueError as error:
        raise ConfigError(str(error)) from error
    if (args.lora_modules or args.enable_lora_updates) and not args.enable_lora:
        raise ConfigError("--lora-modules and --enable-lora-updates need --enable-lora")
    if not 1 <= args.port <= 65535:
        raise ConfigError(f"port must be in [1, 65535], got {args.port}")
    check_port_free(args.host, args.port)


def check_port_free(host: str, port: int) -> None:
    """Bind host:port as uvicorn will (SO_REUSEADDR), then let go, so a busy port fails now
    rather than after minutes of loading the model."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        raise ConfigError(f"host {host!r} does not resolve: {error.strerror}") from error
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            raise ConfigError(f"cannot listen on {host}:{port}: {error.strerror}") from error
