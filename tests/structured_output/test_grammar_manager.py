"""The compile manager: compiles in threads, shares one compile per spec, fails only the bad spec."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from structured_output.byte_tokenizer import save_byte_tokenizer
from transformers import LlamaConfig

from pagoda.errors import InvalidRequestError
from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output.backend import GrammarBackend, get_backend
from pagoda.structured_output.manager import StructuredOutputManager


@pytest.fixture(scope="module")
def model_config(tmp_path_factory) -> SimpleNamespace:
    """Just what `get_backend` reads of a ModelConfig: a checkpoint directory with a tokenizer."""
    path = str(tmp_path_factory.mktemp("byte-tokenizer"))
    save_byte_tokenizer(path)
    hf_config = LlamaConfig(vocab_size=256, eos_token_id=0)
    return SimpleNamespace(model=path, load_format="auto", tokenizer=None, vocab_size=256, hf_config=hf_config)


def test_compiles_off_the_calling_thread_once_per_spec(model_config, monkeypatch) -> None:
    threads: list[str] = []
    compile_ = GrammarBackend._compile

    def recording(self, spec):
        threads.append(threading.current_thread().name)
        time.sleep(0.2)
        return compile_(self, spec)

    monkeypatch.setattr(GrammarBackend, "_compile", recording)
    manager = StructuredOutputManager(model_config)
    try:
        params = StructuredOutputsParams(regex=r"manager-\d")
        start = time.perf_counter()
        first, second = manager.submit(params), manager.submit(StructuredOutputsParams(regex=r"manager-\d"))
        assert time.perf_counter() - start < 0.1 and not first.done()
        assert first is second
        assert first.result(timeout=30) is manager.submit(params).result(timeout=1)
        assert len(threads) == 1 and threads[0].startswith("pagoda-grammar")
        assert get_backend(model_config).stop_token_ids == [0]
    finally:
        manager.shutdown()


def test_a_failed_compile_is_the_futures_error(model_config, monkeypatch) -> None:
    def failing(self, spec):
        raise InvalidRequestError(spec.field, f"{spec.field} is not a valid JSON schema: broken")

    monkeypatch.setattr(GrammarBackend, "_compile", failing)
    manager = StructuredOutputManager(model_config)
    try:
        future = manager.submit(StructuredOutputsParams(json={"type": "string", "title": "failing"}))
        error = future.exception(timeout=30)
        assert isinstance(error, InvalidRequestError) and error.param == "structured_outputs.json"
    finally:
        manager.shutdown()
