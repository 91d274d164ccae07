"""The README's examples, run as a user would, against the default model: each must succeed and
answer sensibly (the capital of France is Paris; no loops).

Blocks are marked in README.md by a comment on the line before the fence:
`<!-- readme-test: KIND -->`, KIND one of cli (each line a `pagoda` command), python (offline),
server (its first line starts `pagoda serve`, the rest is curl against it) and client (Python
against that server). Port 8000 is replaced by the test server's.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest

from tests.server_utils import HTTP_TIMEOUT_S, REPO_ROOT, RemoteServer

README = f"{REPO_ROOT}/README.md"
KINDS = {"cli", "python", "server", "client"}
_BLOCK = re.compile(r"<!-- readme-test: (\w+) -->\n```\w*\n(.*?)\n```", re.S)
PAGODA = [sys.executable, "-m", "pagoda.entrypoints.cli"]
# Least share of distinct words in an answer: a loop ("a gentle rain, a gentle rain, ...") is far below.
MIN_DISTINCT_WORD_RATIO = 0.4
CHAT_INPUT = "What is the capital of France?\n\n"


def readme_blocks() -> dict[str, str]:
    with open(README) as file:
        return dict(_BLOCK.findall(file.read()))


def distinct_word_ratio(text: str) -> float:
    words = re.findall(r"\w+", text.lower())
    return len(set(words)) / len(words) if words else 0.0


def assert_sensible(answer: str, asked: str) -> None:
    """Non-empty, not looping, and Paris when the question was France's capital."""
    assert answer.strip(), f"empty answer to {asked!r}"
    assert distinct_word_ratio(answer) > MIN_DISTINCT_WORD_RATIO, f"a loop? {answer!r}"
    if "capital of France" in asked:
        assert "Paris" in answer, answer


def run(command: list[str], stdin: str | None = None) -> str:
    done = subprocess.run(command, cwd=REPO_ROOT, input=stdin, capture_output=True, text=True, timeout=HTTP_TIMEOUT_S)
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done.stdout


def test_every_kind_of_example_is_marked() -> None:
    assert set(readme_blocks()) == KINDS


def test_cli_examples() -> None:
    lines = [shlex.split(line, comments=True) for line in readme_blocks()["cli"].splitlines()]
    for words in lines:
        assert words[0] == "pagoda", words
        stdin = CHAT_INPUT if words[1] == "chat" else None
        asked = stdin or " ".join(words)
        assert_sensible(run(PAGODA + words[1:], stdin), asked)


def test_python_example() -> None:
    code = readme_blocks()["python"]
    assert_sensible(run([sys.executable, "-c", code]), code)


@pytest.fixture(scope="module")
def server():
    serve, *_ = readme_blocks()["server"].splitlines()
    words = shlex.split(serve, comments=True)
    assert words[:2] == ["pagoda", "serve"] and words[2:4] == ["--port", "8000"], words
    server = RemoteServer(*words[4:])
    yield server
    server.stop()


def with_port(text: str, port: int) -> str:
    return text.replace(":8000", f":{port}")


def test_server_curl_example(server: RemoteServer) -> None:
    _, *curl = readme_blocks()["server"].splitlines()
    command = with_port("\n".join(curl), server.port)
    body = json.loads(run(["bash", "-c", command]))
    assert_sensible(body["choices"][0]["message"]["content"], command)


def test_server_client_example(server: RemoteServer) -> None:
    code = with_port(readme_blocks()["client"], server.port)
    assert_sensible(run([sys.executable, "-c", code]), code)
