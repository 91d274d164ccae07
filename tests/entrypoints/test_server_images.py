"""Images through the OpenAI chat API (a tiny random LLaVA served by `pagoda serve`): the openai
SDK sends an image_url part and gets the answer offline `LLM.chat` gives; bad images (truncated,
20k x 20k, wrong base64, a host not allowed) are 400s naming the message, and the server stays
healthy; an http URL is fetched from an allowed host."""

from __future__ import annotations

import base64
import http.server
import os
import threading

import openai
import pytest
from engine_utils import target_settings
from server_utils import RemoteServer, assert_error
from vlm_utils import png_bytes, png_header_only, random_image

from pagoda.entrypoints.llm import LLM
from pagoda.sampling_params import SamplingParams

PNG = png_bytes(random_image(40, 36, 11))


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def messages_with(url: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "text", "text": "w1 w2"}, {"type": "image_url", "image_url": {"url": url}}],
        }
    ]


@pytest.fixture(scope="module")
def image_host():
    """An HTTP server on 127.0.0.1 serving PNG at /cat.png."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/cat.png"
    server.shutdown()


@pytest.fixture(scope="module")
def llava_server(tiny_llava_path):
    server = RemoteServer(
        *("--model", tiny_llava_path, "--device", "cpu", "--dtype", "float32", "--max-model-len", "256"),
        *("--enable-debug-routes", "--allowed-media-domains", "127.0.0.1"),
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiny_llava_path(tmp_path_factory) -> str:
    from vlm_utils import save_tiny_llava

    path = str(tmp_path_factory.mktemp("llava-served"))
    save_tiny_llava(path)
    return path


def test_openai_sdk_sends_an_image_and_gets_the_offline_answer(llava_server, tiny_llava_path, image_host) -> None:
    client = openai.OpenAI(base_url=f"{llava_server.url}/v1", api_key="none")
    model = os.path.basename(tiny_llava_path)
    answers = []
    for url in (data_url(PNG), image_host):
        completion = client.chat.completions.create(
            model=model, messages=messages_with(url), max_tokens=4, temperature=0
        )
        answers.append(completion.choices[0].message.content)
        assert completion.usage.prompt_tokens > 25  # the image's 25 placeholders and the text
    llm = LLM(tiny_llava_path, max_model_len=256, **target_settings(("cpu", "torch", False)))
    offline = llm.chat(messages_with(data_url(PNG)), SamplingParams(temperature=0, max_tokens=4))
    assert answers == [offline[0].outputs[0].text] * 2


@pytest.mark.parametrize(
    ("url", "words"),
    [
        pytest.param(data_url(PNG[: len(PNG) // 2]), "not a readable image", id="truncated"),
        pytest.param(data_url(png_header_only(20_000, 20_000)), "pixels", id="20k-x-20k"),
        pytest.param("data:image/png;base64,%%%not-base64", "base64", id="wrong-base64"),
        pytest.param("https://example.com/cat.png", "not allowed", id="host-not-allowed"),
    ],
)
def test_bad_images_are_400s_and_the_server_stays_healthy(llava_server, url: str, words: str) -> None:
    body = {"messages": messages_with(url), "max_tokens": 2}
    assert_error(llava_server.post("/v1/chat/completions", json=body), 400, "messages[0].content", words)
    assert llava_server.get("/health").status_code == 200
    good = {"messages": messages_with(data_url(PNG)), "max_tokens": 2}
    assert llava_server.post("/v1/chat/completions", json=good).status_code == 200
    assert llava_server.wait_idle()["idle"]


def test_too_many_images_are_refused_before_any_is_decoded(llava_server) -> None:
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,not-even-base64"}}] * 17
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}
    assert_error(llava_server.post("/v1/chat/completions", json=body), 400, "messages", "at most 16")
