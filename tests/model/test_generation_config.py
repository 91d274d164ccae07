"""Sampling defaults from the model: generation_config.json, GGUF metadata, --generation-config,
and where they apply (offline LLM without sampling params, server fields a client left unset)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

gguf = pytest.importorskip("gguf")  # writes the test files (GPU images lack it, and the server stack)

from pagoda.config import ConfigError  # noqa: E402
from pagoda.entrypoints.openai.protocol import CompletionRequest  # noqa: E402
from pagoda.entrypoints.openai.serving_base import OpenAIServing  # noqa: E402
from pagoda.model.loader import default_model_path, load_sampling_defaults  # noqa: E402
from pagoda.model.loader.gguf_loader import read_gguf_sampling_defaults  # noqa: E402


def _model_dir(path, **generation_config) -> str:
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text("{}")
    (path / "generation_config.json").write_text(json.dumps(generation_config))
    return str(path)


def test_auto_takes_the_sampling_fields_of_generation_config_json(tmp_path) -> None:
    model = _model_dir(tmp_path / "m", temperature=0.6, top_p=0.95, top_k=20, do_sample=True, max_new_tokens=9)
    assert load_sampling_defaults(model, "safetensors") == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


def test_vllm_mode_and_a_model_without_generation_config_give_no_defaults(tmp_path) -> None:
    model = _model_dir(tmp_path / "m", temperature=0.6)
    assert load_sampling_defaults(model, "safetensors", "vllm") == {}
    (tmp_path / "m" / "generation_config.json").unlink()
    assert load_sampling_defaults(model, "safetensors") == {}
    assert load_sampling_defaults("qwen3-0.6b", "dummy") == {}


def test_a_folder_overrides_the_models_own(tmp_path) -> None:
    model = _model_dir(tmp_path / "m", temperature=0.6)
    other = _model_dir(tmp_path / "other", repetition_penalty=1.05, min_p=0.1)
    assert load_sampling_defaults(model, "safetensors", other) == {"repetition_penalty": 1.05, "min_p": 0.1}
    with pytest.raises(ConfigError, match="generation_config must be 'auto', 'vllm' or a folder"):
        load_sampling_defaults(model, "safetensors", str(tmp_path / "missing"))


def test_an_invalid_default_fails_at_startup(tmp_path) -> None:
    model = _model_dir(tmp_path / "m", top_p=0.0)
    with pytest.raises(ConfigError, match="top_p"):
        load_sampling_defaults(model, "safetensors")


def test_gguf_sampling_metadata(tmp_path) -> None:
    path = str(tmp_path / "s.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_float32("general.sampling.temp", 0.5)
    writer.add_int32("general.sampling.top_k", 40)
    writer.add_float32("general.sampling.penalty_repeat", 1.25)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_gguf_sampling_defaults(path) == {"temperature": 0.5, "top_k": 40, "repetition_penalty": 1.25}
    assert read_gguf_sampling_defaults(default_model_path()) == {}  # the default SmolLM2 carries none


def _serving(default_sampling: dict) -> OpenAIServing:
    config = SimpleNamespace(model_config=SimpleNamespace(default_sampling=default_sampling))
    return OpenAIServing(SimpleNamespace(config=config, tokenizer=None), "m")


def test_the_server_fills_only_the_fields_a_client_left_unset() -> None:
    serving = _serving({"temperature": 0.6, "top_p": 0.95, "repetition_penalty": 1.1})
    params = serving.sampling_params(CompletionRequest(prompt="x", temperature=0.0), None)
    assert (params.temperature, params.top_p, params.repetition_penalty) == (0.0, 0.95, 1.1)
    assert _serving({}).sampling_params(CompletionRequest(prompt="x"), 5).temperature == 1.0
