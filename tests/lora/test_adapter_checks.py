"""Adapters that do not fit are refused before they reach the engine, with an error naming the
adapter and the limit (`param` lora_request), and the engine keeps serving; LoRA settings
without enable_lora, and LoRA requests to an engine without it, are refused too."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from lora_utils import AdapterSpec, save_random_adapter
from transformers import AutoModelForCausalLM, LlamaConfig

from pagoda import LLM, LoRARequest, SamplingParams
from pagoda.config import ConfigError
from pagoda.errors import InvalidRequestError

PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_base) -> LLM:
    path, _ = tiny_base
    return LLM(model=path, device="cpu", dtype="float32", max_model_len=64, enable_lora=True, max_lora_rank=8)


def _refused(llm: LLM, lora: LoRARequest, *words: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False, lora_request=lora)
    assert info.value.param == "lora_request"
    message = str(info.value)
    assert lora.lora_name in message and all(word in message for word in words), message


def test_adapter_over_max_rank(llm, adapters) -> None:
    _refused(llm, adapters[1], "rank 16", "max_lora_rank (8)")


def test_adapter_of_another_model(llm, tiny_base, tmp_path) -> None:
    config = LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2
    )
    save_random_adapter(AutoModelForCausalLM.from_config(config), AdapterSpec(rank=4, alpha=8), str(tmp_path), 0)
    _refused(llm, LoRARequest("small", 7, str(tmp_path)), "has shape", "the model needs")


def test_missing_files_and_unsupported_settings(llm, adapters, tmp_path) -> None:
    _refused(llm, LoRARequest("nowhere", 8, str(tmp_path / "missing")), "no adapter_config.json")
    dora = tmp_path / "dora"
    shutil.copytree(adapters[0].lora_path, dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    _refused(llm, LoRARequest("dora", 9, str(dora)), "use_dora")
    (dora / "adapter_config.json").write_text(json.dumps(config))
    (dora / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    _refused(llm, LoRARequest("dora", 9, str(dora)), "cannot read adapter_model.safetensors")
    os.remove(dora / "adapter_model.safetensors")
    _refused(llm, LoRARequest("dora", 9, str(dora)), "no adapter_model.safetensors")


def test_one_id_names_one_adapter(llm, adapters) -> None:
    first = adapters[0]
    llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False, lora_request=first)
    _refused(llm, LoRARequest("other", first.lora_int_id, adapters[2].lora_path), "already names adapter")
    # The engine still serves, with and without adapters.
    outputs = llm.generate([[1, 2, 3]] * 2, PARAMS, use_tqdm=False, lora_request=[first, None])
    assert all(len(o.outputs[0].token_ids) == 2 for o in outputs)


def test_lora_request_fields() -> None:
    lora = LoRARequest("a", 3, "/adapters/a")
    assert (lora.name, lora.adapter_id, lora.path) == ("a", 3, "/adapters/a")  # vLLM's aliases
    with pytest.raises(InvalidRequestError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("a", 0, "/tmp")
    with pytest.raises(InvalidRequestError, match="lora_name"):
        LoRARequest("", 1, "/tmp")


def test_lora_needs_enable_lora(tiny_base, adapters) -> None:
    path, _ = tiny_base
    with pytest.raises(ConfigError, match="max_loras need enable_lora=True"):
        LLM(model=path, device="cpu", max_loras=2)
    with pytest.raises(ConfigError, match="max_lora_rank must be an integer in \\[1, 64\\]"):
        LLM(model=path, device="cpu", enable_lora=True, max_lora_rank=65)
    with LLM(model=path, device="cpu", dtype="float32", max_model_len=64) as plain:
        with pytest.raises(InvalidRequestError, match="enable_lora=True") as info:
            plain.generate([[1, 2]], PARAMS, use_tqdm=False, lora_request=adapters[0])
        assert info.value.param == "lora_request"


def test_vllm_import_path() -> None:
    from pagoda import LoRARequest as top_level
    from pagoda.lora.request import LoRARequest as vllm_path

    assert top_level is vllm_path
