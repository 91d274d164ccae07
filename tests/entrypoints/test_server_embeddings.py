"""`/v1/embeddings`, `/v1/score` and `/rerank` on a real `pagoda serve` of a tiny BERT (mean
pooling, normalized), through the openai SDK and plain HTTP; and the routes of the wrong task."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
from pooling_utils import BERT_MAX_POSITIONS, cosine, save_tiny_bert
from server_utils import SMALL_SERVER, RemoteServer, assert_error

NAME = "tiny-bert"
TEXTS = ["the cat sat on the mat", "a dog ran fast", "big red trees"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-bert-server"))
    save_tiny_bert(path)
    return path


@pytest.fixture(scope="module")
def server(start_server, checkpoint: str) -> RemoteServer:
    return start_server("--model", checkpoint, "--served-model-name", NAME, "--max-num-batched-tokens", "32")


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(checkpoint: str) -> np.ndarray:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    return sentence_transformers.SentenceTransformer(checkpoint, device="cpu").encode(TEXTS)


def test_openai_sdk_embeddings_match_sentence_transformers(client: openai.OpenAI, reference: np.ndarray) -> None:
    # The SDK asks for base64 and decodes it; "float" is the plain JSON list.
    for encoding_format in (openai.NOT_GIVEN, "float"):
        response = client.embeddings.create(model=NAME, input=TEXTS, encoding_format=encoding_format)
        assert [item.index for item in response.data] == [0, 1, 2]
        for item, expected in zip(response.data, reference, strict=True):
            assert cosine(item.embedding, expected) > 1 - 1e-5
        assert response.model == NAME
        assert response.usage.prompt_tokens == response.usage.total_tokens > len(TEXTS)
    one = client.embeddings.create(model=NAME, input=TEXTS[0])
    assert cosine(one.data[0].embedding, reference[0]) > 1 - 1e-5


def test_token_ids_dimensions_and_base64(server: RemoteServer, reference: np.ndarray) -> None:
    tokens = server.post("/tokenize", json={"prompt": TEXTS[1]}).json()["tokens"]
    body = {"model": NAME, "input": [tokens], "dimensions": 8, "encoding_format": "base64"}
    response = server.post("/v1/embeddings", json=body)
    assert response.status_code == 200, response.text
    vector = np.frombuffer(base64.b64decode(response.json()["data"][0]["embedding"]), dtype="<f4")
    expected = reference[1][:8] / np.linalg.norm(reference[1][:8])
    np.testing.assert_allclose(vector, expected, atol=1e-5)
    assert response.json()["usage"]["prompt_tokens"] == len(tokens)


def test_over_long_inputs_are_400s_naming_the_field(server: RemoteServer) -> None:
    words = " ".join(["cat"] * BERT_MAX_POSITIONS)
    response = server.post("/v1/embeddings", json={"model": NAME, "input": words})
    assert_error(response, 400, "input", "max_model_len")
    # Under max_model_len but over the one step an encoder's prompt must fit in (32 tokens).
    response = server.post("/v1/embeddings", json={"model": NAME, "input": " ".join(["cat"] * 38)})
    assert_error(response, 400, "input", "max_num_batched_tokens = 32")
    response = server.post("/v1/embeddings", json={"model": NAME, "input": words, "truncate_prompt_tokens": 12})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 12
    response = server.post("/v1/embeddings", json={"model": NAME, "input": "cat", "dimensions": 33})
    assert_error(response, 400, "dimensions", "hidden size")


def test_score_and_rerank(server: RemoteServer, reference: np.ndarray) -> None:
    response = server.post("/v1/score", json={"model": NAME, "text_1": TEXTS[0], "text_2": TEXTS[1:]})
    assert response.status_code == 200, response.text
    scores = [item["score"] for item in response.json()["data"]]
    assert scores == pytest.approx([cosine(reference[0], other) for other in reference[1:]], abs=1e-5)
    response = server.post("/rerank", json={"model": NAME, "query": TEXTS[0], "documents": TEXTS[1:], "top_n": 1})
    assert response.status_code == 200, response.text
    (best,) = response.json()["results"]
    assert best["index"] == int(np.argmax(scores)) and best["relevance_score"] == pytest.approx(max(scores), abs=1e-5)
    assert best["document"]["text"] == TEXTS[1 + best["index"]]
    assert_error(server.post("/v1/score", json={"text_1": TEXTS[:2], "text_2": TEXTS}), 400, "text_2", "text_2 has 3")


def test_an_embedding_server_generates_nothing(server: RemoteServer) -> None:
    response = server.post("/v1/completions", json={"model": NAME, "prompt": "the cat", "max_tokens": 2})
    assert_error(response, 400, "model", "embedding model")


def test_a_generative_server_embeds_nothing(shared_server) -> None:
    server = shared_server(*SMALL_SERVER)
    response = server.post("/v1/embeddings", json={"input": "hello"})
    assert_error(response, 400, "model", "/v1/embeddings needs an embedding model", "--task embed")
