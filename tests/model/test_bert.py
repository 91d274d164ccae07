"""BERT (`BertModel`) as an embedding model: vectors against sentence-transformers (mean pooling,
normalized), CLS pooling against HF transformers, no KV cache kept, and the one-step rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pooling_utils import BERT_MAX_POSITIONS, cosine, save_tiny_bert

from pagoda import LLM
from pagoda.errors import InvalidRequestError

TEXTS = ["the cat sat on the mat", "a dog ran", "big red blue green trees over the small house", "cats"]
# A step of 24 tokens: the texts (8 to 13 tokens with [CLS] and [SEP]) run over several steps.
ENGINE_ARGS = {"dtype": "float32", "device": "cpu", "max_num_batched_tokens": 24}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[str, torch.nn.Module]:
    path = str(tmp_path_factory.mktemp("tiny-bert"))
    return path, save_tiny_bert(path)


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    with LLM(checkpoint[0], **ENGINE_ARGS) as llm:  # task "auto": BERT embeds
        yield llm


def test_mean_pooling_matches_sentence_transformers(llm: LLM, checkpoint) -> None:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model_config = llm.llm_engine.config.model_config
    assert model_config.task == "embed"
    assert (model_config.pooler_config.pooling_type, model_config.pooler_config.normalize) == ("MEAN", True)
    reference = sentence_transformers.SentenceTransformer(checkpoint[0], device="cpu").encode(TEXTS)
    outputs = llm.embed(TEXTS, use_tqdm=False)
    for output, expected in zip(outputs, reference, strict=True):
        assert cosine(output.outputs.embedding, expected) > 1 - 1e-5
        np.testing.assert_allclose(output.outputs.embedding, expected, atol=1e-5)
    assert outputs[0].prompt_token_ids[0] == llm.get_tokenizer().cls_token_id


def test_cls_pooling_matches_hf(checkpoint) -> None:
    path, hf_model = checkpoint
    tokenizer_args = {"return_tensors": "pt"}
    with LLM(path, pooler_config={"pooling_type": "CLS", "normalize": False}, **ENGINE_ARGS) as llm:
        tokenizer = llm.get_tokenizer()
        outputs = llm.embed(TEXTS[:2], use_tqdm=False)
    for text, output in zip(TEXTS[:2], outputs, strict=True):
        with torch.inference_mode():
            expected = hf_model(**tokenizer(text, **tokenizer_args)).last_hidden_state[0, 0]
        np.testing.assert_allclose(output.outputs.embedding, expected.numpy(), atol=1e-5)


def test_an_encoder_keeps_no_kv_cache(llm: LLM) -> None:
    scheduler = llm.llm_engine.engine_core.scheduler
    config = scheduler.kv_cache_manager.kv_cache_config
    assert config.kv_cache_tensors == ()
    assert [type(spec).__name__ for spec in config.group_specs] == ["EncoderOnlyAttentionSpec"]
    assert scheduler.whole_prompt_pooling
    llm.embed(TEXTS, use_tqdm=False)
    assert scheduler.kv_cache_manager.prefix_cache_hits == 0


def test_long_inputs_are_refused_or_truncated(llm: LLM) -> None:
    longest = " ".join(["cat"] * (BERT_MAX_POSITIONS - 1))  # 63 words + [CLS] and [SEP]: 65 tokens
    with pytest.raises(InvalidRequestError, match="max_model_len") as error:
        llm.embed(longest, use_tqdm=False)
    assert error.value.param == "prompt"
    tokenizer = llm.get_tokenizer()
    cut = llm.embed(longest, truncate_prompt_tokens=10, use_tqdm=False)[0]
    assert len(cut.prompt_token_ids) == 10
    assert (cut.prompt_token_ids[0], cut.prompt_token_ids[-1]) == (tokenizer.cls_token_id, tokenizer.sep_token_id)
    # Within max_model_len but over the step's 24 tokens: an encoder cannot split a prompt.
    with pytest.raises(InvalidRequestError, match="max_num_batched_tokens = 24"):
        llm.embed(" ".join(["cat"] * 30), use_tqdm=False)


@pytest.mark.gpu
def test_bert_on_cuda_matches_sentence_transformers(checkpoint) -> None:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    reference = sentence_transformers.SentenceTransformer(checkpoint[0], device="cpu").encode(TEXTS)
    with LLM(checkpoint[0], device="cuda", dtype="float32", max_num_batched_tokens=24) as llm:
        outputs = llm.embed(TEXTS, use_tqdm=False)
    for output, expected in zip(outputs, reference, strict=True):
        assert cosine(output.outputs.embedding, expected) > 1 - 1e-4
