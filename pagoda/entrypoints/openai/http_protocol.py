"""uvicorn's h11 protocol with the guards it lacks against clients that hold connections open.

uvicorn starts no timer before a response completes, and its keep-alive timer stops at the
first byte, so a half-sent header or a body that never arrives held a connection forever; its
`limit_concurrency` answers 503 only once a request's header is complete. Here every connection
has a deadline for what the server waits on from the client (the request's header, counted
from the connection's opening or the previous response's end; then its body, counted from the
end of the header), never for the server's own answer, so a long stream is not cut; a
connection beyond `max_connections` is answered 503 and closed at once; and a request whose
body length is ambiguous (Content-Length with Transfer-Encoding, or Transfer-Encoding in
HTTP/1.0: RFC 9112 §6.1, §6.3) is answered 400 and its connection closed, so nothing pipelined
behind it is read. h11 itself refuses conflicting Content-Lengths, codings other than chunked
and malformed header lines.
"""

from __future__ import annotations

import asyncio
import http
import json
from dataclasses import dataclass
from typing import Any

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from pagoda.entrypoints.openai.errors import OpenAIError


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float
    body_timeout_s: float


class FramingCheckedConnection(h11.Connection):
    """h11's connection, refusing the requests whose framing h11 accepts but RFC 9112 calls
    faulty, before the app sees them (uvicorn answers the error 400 and closes)."""

    def next_event(self) -> Any:
        event = super().next_event()
        if isinstance(event, h11.Request):
            names = {name for name, _ in event.headers}
            if b"transfer-encoding" in names and (b"content-length" in names or event.http_version == b"1.0"):
                raise h11.RemoteProtocolError("ambiguous request framing", error_status_hint=400)
        return event


def error_response(status: int, message: str, code: str) -> bytes:
    """A complete `Connection: close` response with OpenAI's error body, written straight to
    the transport where h11 cannot frame one (no request read yet, or one half read)."""
    body = json.dumps(OpenAIError(status, message, code=code).body()).encode()
    head = (
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """One connection; see the module docstring for the guards."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        limits: ConnectionLimits,
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self.conn = FramingCheckedConnection(
            h11.SERVER, config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        )
        self.deadline: asyncio.TimerHandle | None = None
        self.awaiting: str | None = None  # "header" or "body": what the deadline is for

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self.transport = transport
            message = f"the server has {self.limits.max_connections} connections open (--max-connections)"
            transport.write(error_response(503, message, "too_many_connections"))
            transport.close()
            return
        super().connection_made(transport)
        self._watch_client()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_client()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start on a pipelined request
        self._watch_client()

    def _watch_client(self) -> None:
        """Arm the deadline for what the connection waits on from the client now, keeping the
        one already running for the same part of the same request."""
        awaiting = None
        if not self.transport.is_closing():
            awaiting = {h11.IDLE: "header", h11.SEND_BODY: "body"}.get(self.conn.their_state)
        if awaiting == self.awaiting:
            return
        self._disarm()
        if awaiting is not None:
            timeout = self.limits.header_timeout_s if awaiting == "header" else self.limits.body_timeout_s
            self.deadline = self.loop.call_later(timeout, self._client_too_slow)
            self.awaiting = awaiting

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline = None
        self.awaiting = None

    def _client_too_slow(self) -> None:
        """Close the connection, answering 408 where a request was begun and not yet answered
        (not on an idle connection, whose client may be sending its next request right now)."""
        if self.awaiting == "body" and not self.cycle.response_started:
            message = f"the request body did not arrive within {self.limits.body_timeout_s:g} s (--body-timeout)"
            self.transport.write(error_response(408, message, "request_timeout"))
            self.cycle.disconnected = True  # the app's reads end, its writes are dropped
            self.cycle.message_event.set()
        elif self.awaiting == "header" and self.conn.trailing_data[0]:
            message = f"the request header did not arrive within {self.limits.header_timeout_s:g} s (--header-timeout)"
            self.transport.write(error_response(408, message, "request_timeout"))
        self._disarm()
        self.transport.close()
