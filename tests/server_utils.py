"""A real `pagoda serve` in a subprocess on 127.0.0.1, for tests that drive it over HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx

from pagoda.distributed.parallel_state import free_port

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Deadlines for events that come in seconds on a quiet machine: generous, so that a loaded one
# (CI, a laptop running other tests) only waits longer, and only a failing test waits them out.
STARTUP_TIMEOUT_S = 600
HTTP_TIMEOUT_S = 300
EXIT_TIMEOUT_S = 120
API_KEY = "sk-test"  # the key the tests start a server with when they need one
MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the name the default model is served under
# The tests' HTTP client. `httpx.get` and the like build a client, and its TLS context, on every
# call: ~35 ms of CPU a request on the 2-core CI machine, and a server's start polled every 0.1 s
# spent a quarter of a core on it. Each request still has a connection of its own (Connection:
# close), as with those calls: none is kept alive to count against a server's --max-connections
# or to meet its idle deadline. httpx's client is safe to share between threads.
HTTP = httpx.Client(headers={"Connection": "close"})

# Servers several test modules share for the whole session (`shared_server` in
# tests/entrypoints/conftest.py): one start each instead of one per module.
# Small limits, for the modules that drive requests to them (limits, sampling, validation):
SMALL_CONTEXT, SMALL_MAX_NUM_SEQS, SMALL_MAX_QUEUED, SMALL_MAX_BODY = 64, 2, 4, 65536
SMALL_SERVER = (
    *("--max-model-len", str(SMALL_CONTEXT)),
    *("--max-num-seqs", str(SMALL_MAX_NUM_SEQS), "--max-num-queued-requests", str(SMALL_MAX_QUEUED)),
    *("--max-request-body-bytes", str(SMALL_MAX_BODY), "--trust-request-chat-template", "--enable-debug-routes"),
)
# The API behind a key, with a short context (api, security):
KEYED_CONTEXT = 256
KEYED_SERVER = ("--max-model-len", str(KEYED_CONTEXT), "--enable-debug-routes")
# A context long enough for clients' chats and the Responses API, behind a key, request chat
# templates allowed (clients, responses, request fields, the chat page):
LONG_CONTEXT = 1024
LONG_SERVER = ("--max-model-len", str(LONG_CONTEXT), "--enable-debug-routes", "--trust-request-chat-template")


def assert_error(response: httpx.Response, status: int, param: str | None, *words: str) -> dict:
    """An OpenAI error body with `status`, naming `param` and containing each of `words`."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error


def child_pids(pid: int) -> list[int]:
    """Direct children of a process (Linux /proc)."""
    children: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as file:
            children += [int(child) for child in file.read().split()]
    return children


def is_running(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_until(condition, timeout_s: float, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval_s)
    return condition()


class RemoteServer:
    def __init__(self, *serve_args: str, api_key: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        args = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", "--port", str(self.port), *serve_args]
        if api_key is not None:
            args += ["--api-key", api_key]
        self.process = subprocess.Popen(args, cwd=REPO_ROOT)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, **kwargs) -> httpx.Response:
        kwargs.setdefault("timeout", HTTP_TIMEOUT_S)
        return HTTP.get(self.url + path, headers=self.headers, **kwargs)

    def post(self, path: str, **kwargs) -> httpx.Response:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        kwargs.setdefault("timeout", HTTP_TIMEOUT_S)
        return HTTP.post(self.url + path, headers=headers, **kwargs)

    def metrics(self) -> dict[str, float]:
        """/metrics as {sample name with its labels: value}."""
        values = {}
        for line in self.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def core_pid(self) -> int:
        """The engine core process: the server's child that is not multiprocessing's resource
        tracker (forked, the core has the server's command line; spawned, multiprocessing's)."""
        for pid in child_pids(self.process.pid):
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                if b"resource_tracker" not in file.read():
                    return pid
        raise AssertionError("no engine core process found")

    def wait_idle(self, timeout_s: float = HTTP_TIMEOUT_S) -> dict:
        """Poll /debug/idle until the engine holds no request state; returns its last answer."""
        answer: dict = {}

        def idle() -> bool:
            nonlocal answer
            answer = self.get("/debug/idle").json()
            return answer["idle"]

        wait_until(idle, timeout_s, interval_s=0.2)
        return answer

    def wait_unhealthy(self, timeout_s: float = EXIT_TIMEOUT_S) -> httpx.Response:
        """Poll /health until it answers other than 200; returns that answer. A server whose
        engine core died answers only for a few seconds before it exits: start polling before
        the failure (in a thread, beside the requests it fails), not after it."""
        answer: httpx.Response | None = None

        def unhealthy() -> bool:
            nonlocal answer
            answer = self.get("/health")
            return answer.status_code != 200

        assert wait_until(unhealthy, timeout_s), f"/health still 200 after {timeout_s:g} s"
        return answer

    def stop(self) -> int:
        """SIGTERM, as a supervisor would; returns the exit code (uvicorn re-raises the signal
        once it has shut down cleanly, so -SIGTERM is a clean exit) and checks no child is left."""
        children = child_pids(self.process.pid) if self.process.poll() is None else []
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait(EXIT_TIMEOUT_S)
        left = [pid for pid in children if not wait_until(lambda pid=pid: not is_running(pid), EXIT_TIMEOUT_S)]
        assert not left, f"processes left behind by the server: {left}"
        return code

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.process.returncode} while starting")
            try:
                if HTTP.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"the server did not become healthy within {STARTUP_TIMEOUT_S} s")


def stand_in_engine(**config: object) -> SimpleNamespace:
    """An engine for building the server's app without one: building it reads the model's
    length and config (does it take images), the tokenizer, and whatever `config` adds (such
    as a cache_config); no request may reach it."""
    model_config = SimpleNamespace(max_model_len=128, hf_config=SimpleNamespace(model_type="llama"))
    return SimpleNamespace(config=SimpleNamespace(model_config=model_config, **config), tokenizer=None)
