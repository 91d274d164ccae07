"""The processor's token-id checks, which run over whole prompts at add time without a Python
loop per token: every kind of bad id is still refused, naming the field."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagoda.engine.processor import Processor
from pagoda.errors import InvalidRequestError
from pagoda.sampling_params import SamplingParams

VOCAB = 100


def processor() -> Processor:
    model_config = SimpleNamespace(
        max_model_len=64, vocab_size=VOCAB, is_embedding_model=False, pooling_needs_whole_prompt=False, hf_config=None
    )
    config = SimpleNamespace(model_config=model_config, lora_config=None)
    return Processor(config, tokenizer=None, eos_token_ids={0})


@pytest.mark.parametrize(
    "prompt",
    [[1, True, 2], [1, 2.0], [1, "2"], [1, None]],
    ids=["bool", "float", "str", "none"],
)
def test_prompt_of_non_int_ids_is_refused(prompt: list) -> None:
    with pytest.raises(InvalidRequestError, match="list of token ids"):
        processor().tokenize(prompt)


@pytest.mark.parametrize("bad", [-1, VOCAB, 10**12])
def test_prompt_id_outside_the_vocabulary_is_refused_by_value(bad: int) -> None:
    with pytest.raises(InvalidRequestError, match=f"token id {bad} outside the vocabulary"):
        processor().process("r", [3, bad, 4], SamplingParams(max_tokens=4))


def test_valid_prompt_passes_with_its_ids_unchanged() -> None:
    request, _ = processor().process("r", [0, 5, VOCAB - 1], SamplingParams(max_tokens=4))
    assert request.prompt_token_ids == (0, 5, VOCAB - 1)
