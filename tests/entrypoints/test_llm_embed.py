"""`LLM(task="embed")` on a tiny Qwen3-Embedding-style decoder: last-token vectors against HF
transformers with the same pooling, chunked prefill and prefix-cache hits on the way,
Matryoshka dimensions, scores, and the errors of the pooling path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pooling_utils import cosine, hf_last_token_embedding, save_tiny_qwen3_embedding

from pagoda import LLM, PoolingParams
from pagoda.config import ConfigError
from pagoda.errors import InvalidRequestError
from pagoda.pooling.processing import check_task

# Blocks of 16 and a step budget of 32: a 40-token prompt is prefilled in chunks and fills two
# blocks that a second request of it finds in the prefix cache.
ENGINE_ARGS = {"dtype": "float32", "device": "cpu", "max_num_batched_tokens": 32, "block_size": 16}
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 37)), list(range(40, 80))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[str, torch.nn.Module]:
    path = str(tmp_path_factory.mktemp("tiny-qwen3-embedding"))
    return path, save_tiny_qwen3_embedding(path)


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    with LLM(checkpoint[0], task="embed", **ENGINE_ARGS) as llm:
        yield llm


def test_last_token_embeddings_match_hf(llm: LLM, checkpoint) -> None:
    config = llm.llm_engine.config.model_config
    assert (config.pooler_config.pooling_type, config.pooler_config.normalize) == ("LAST", True)
    outputs = llm.embed(PROMPTS, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.prompt_token_ids == prompt
        assert isinstance(output.outputs.embedding, list) and len(output.outputs.embedding) == 64
        assert all(isinstance(value, float) for value in output.outputs.embedding)
        assert cosine(output.outputs.embedding, hf_last_token_embedding(checkpoint[1], prompt)) > 1 - 1e-5
        assert np.linalg.norm(output.outputs.embedding) == pytest.approx(1.0, abs=1e-5)


def test_a_full_prefix_hit_recomputes_the_last_token(llm: LLM) -> None:
    manager = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    prompt = list(range(100, 132))  # exactly two blocks: the hit stops one block short
    first = llm.embed(prompt, use_tqdm=False)[0].outputs.embedding
    hits_before = manager.prefix_cache_hits
    second = llm.embed(prompt, use_tqdm=False)[0].outputs.embedding
    assert manager.prefix_cache_hits - hits_before == 16
    np.testing.assert_allclose(second, first, atol=1e-6)


def test_dimensions_cut_then_normalize(llm: LLM) -> None:
    prompt = PROMPTS[1]
    raw = np.array(llm.embed(prompt, PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding)
    cut = llm.embed(prompt, PoolingParams(dimensions=8), use_tqdm=False)[0].outputs.embedding
    np.testing.assert_allclose(cut, raw[:8] / np.linalg.norm(raw[:8]), atol=1e-6)
    with pytest.raises(InvalidRequestError, match="hidden size") as error:
        llm.embed(prompt, PoolingParams(dimensions=65), use_tqdm=False)
    assert error.value.param == "dimensions"


def test_score_is_the_embeddings_cosine(llm: LLM) -> None:
    first, *others = PROMPTS
    scores = llm.score(first, others, use_tqdm=False)
    vectors = [output.outputs.embedding for output in llm.embed(PROMPTS, use_tqdm=False)]
    for score, vector in zip(scores, vectors[1:], strict=True):
        assert score.outputs.score == pytest.approx(cosine(vectors[0], vector), abs=1e-6)
    pairwise = llm.score(PROMPTS[:2], PROMPTS[1:], use_tqdm=False)
    assert pairwise[0].outputs.score == pytest.approx(scores[0].outputs.score, abs=1e-6)
    with pytest.raises(InvalidRequestError, match="text_1 has 2 items"):
        llm.score(PROMPTS[:2], PROMPTS, use_tqdm=False)


def test_long_prompts_are_refused_or_truncated(llm: LLM) -> None:
    too_long = list(range(129))  # max_model_len 128: a pooling prompt may fill it, not pass it
    with pytest.raises(InvalidRequestError, match="max_model_len") as error:
        llm.embed(too_long, use_tqdm=False)
    assert error.value.param == "prompt"
    assert len(llm.embed(too_long[:128], use_tqdm=False)[0].outputs.embedding) == 64
    truncated = llm.embed(too_long, truncate_prompt_tokens=20, use_tqdm=False)[0]
    assert truncated.prompt_token_ids == too_long[:20]  # no tokenizer: cut on the right, as HF's default


def test_the_task_decides_what_a_model_does(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="embedding model") as error:
        llm.generate([1, 2, 3], use_tqdm=False)
    assert error.value.param == "model"
    model_config = llm.llm_engine.config.model_config
    generating = type(model_config)(task="generate", hf_config=model_config.hf_config)
    with pytest.raises(InvalidRequestError, match="task='embed'"):
        check_task(generating, PoolingParams())


def test_mean_pooling_runs_each_prompt_whole(checkpoint) -> None:
    path, hf_model = checkpoint
    with LLM(path, task="embed", pooler_config={"pooling_type": "MEAN"}, **ENGINE_ARGS) as llm:
        outputs = llm.embed(PROMPTS[:2], use_tqdm=False)
        for prompt, output in zip(PROMPTS[:2], outputs, strict=True):
            with torch.inference_mode():
                mean = hf_model(input_ids=torch.tensor([prompt])).last_hidden_state[0].mean(0)
            assert cosine(output.outputs.embedding, mean.numpy()) > 1 - 1e-5
        with pytest.raises(InvalidRequestError, match="max_num_batched_tokens = 32"):
            llm.embed(PROMPTS[2], use_tqdm=False)  # 40 tokens: mean pooling cannot chunk


def test_pooler_config_is_checked(checkpoint) -> None:
    with pytest.raises(ConfigError, match="pooling_type must be one of LAST, MEAN, CLS"):
        LLM(checkpoint[0], task="embed", pooler_config={"pooling_type": "MAX"}, **ENGINE_ARGS)
    with pytest.raises(ConfigError, match="pooler_config is for embedding models"):
        LLM(checkpoint[0], pooler_config={"pooling_type": "MEAN"}, **ENGINE_ARGS)


@pytest.mark.gpu
def test_last_token_embeddings_on_cuda_match_hf(checkpoint) -> None:
    """The Triton attention path (bfloat16, eager: pooling runs no CUDA graph) against HF in float32."""
    path, hf_model = checkpoint
    with LLM(path, task="embed", device="cuda", dtype="bfloat16", max_num_batched_tokens=32) as llm:
        outputs = llm.embed(PROMPTS, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert cosine(output.outputs.embedding, hf_last_token_embedding(hf_model, prompt)) > 0.999
