"""Batch-invariant mode end to end on the CPU: the Triton backend and the batch-invariant GEMM
under TRITON_INTERPRET=1, a tiny random Qwen3 in float32. The same requests (greedy and seeded
random, with logprobs) give identical token ids and logprobs, compared exactly, alone, in a
shuffled batch with random companions and chunked prefill, after prefix-cache hits, without
chunked prefill, and with n-gram speculative decoding (each verified position computed as its
decode would be). Also the settings the mode refuses, each named.

The GPU test of the issue (64 requests, Qwen3-0.6B and Llama-3.1-8B shapes in bf16, batches of
2 to 256, async scheduling and CUDA graphs) is `test_batch_invariance_gpu.py`.
"""

from __future__ import annotations

import random

import pytest
from model_utils import save_random_checkpoint, save_tiny_checkpoint
from transformers import MixtralConfig

pytest.importorskip("triton")  # conftest.py turns on its interpreter when there is no GPU

from pagoda import LLM, SamplingParams
from pagoda.config import ConfigError
from pagoda.engine.arg_utils import create_engine_config
from pagoda.engine.batch_invariance import check_batch_invariant

ENGINE = {
    "device": "cpu",
    "dtype": "float32",
    "max_model_len": 128,
    "block_size": 16,
    "num_gpu_blocks": 64,
    "attention_backend": "triton",
    "batch_invariant": True,
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("qwen3"))
    save_tiny_checkpoint("qwen3", path)
    return path


def requests(count: int, seed: int, max_tokens: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of 17-40 tokens (two of them repeating a phrase, for the n-gram proposer), greedy
    and seeded random in turn, with logprobs."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        phrase = [rng.randrange(3, 250) for _ in range(rng.randint(4, 9))]
        prompts.append(phrase * 4 if i % 2 else [rng.randrange(3, 250) for _ in range(rng.randint(17, 40))])
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.8, seed=seed + i, max_tokens=max_tokens, ignore_eos=True, logprobs=2
        )
        for i in range(count)
    ]
    return prompts, params


def summary(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
        for o in outputs
    ]


def test_requests_alone_and_in_any_batch_are_identical(model_path: str) -> None:
    probes, probe_params = requests(2, seed=0, max_tokens=3)
    llm = LLM(model=model_path, **ENGINE, enable_prefix_caching=False)
    alone = [summary(llm, [prompt], [params])[0] for prompt, params in zip(probes, probe_params, strict=True)]

    # Shuffled among random companions, prefills cut into 24-token chunks beside decodes.
    companions, companion_params = requests(2, seed=1, max_tokens=4)
    order = list(range(4))
    random.Random(2).shuffle(order)
    batch = [(probes + companions)[i] for i in order]
    batch_params = [(probe_params + companion_params)[i] for i in order]
    llm = LLM(model=model_path, **ENGINE, max_num_batched_tokens=24)
    batched = summary(llm, batch, batch_params)
    assert [batched[order.index(i)] for i in range(2)] == alone

    # Again on the same engine: the prompts' full blocks now come from the prefix cache.
    kv_cache_manager = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    hits_before = kv_cache_manager.prefix_cache_hits
    assert summary(llm, probes[::-1], probe_params[::-1]) == alone[::-1]
    assert kv_cache_manager.prefix_cache_hits > hits_before

    # Whole prompts in one step each, both together.
    llm = LLM(model=model_path, **ENGINE, enable_chunked_prefill=False, enable_prefix_caching=False)
    assert summary(llm, probes, probe_params) == alone


def test_speculative_verify_steps_match_decodes(model_path: str) -> None:
    """n-gram drafts verified k + 1 tokens at a time: the same tokens and logprobs as decoding."""
    prompts, params = requests(2, seed=3, max_tokens=4)
    plain = summary(LLM(model=model_path, **ENGINE), prompts, params)
    speculative = LLM(model=model_path, **ENGINE, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert summary(speculative, prompts, params) == plain


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"attention_backend": "torch"}, "attention_backend"),
        ({"enable_lora": True}, "LoRA"),
        ({"task": "embed"}, "task"),
    ],
)
def test_refused_settings_are_named(model_path: str, settings: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        create_engine_config(model=model_path, **{**ENGINE, **settings})


def test_fp8_weights_are_refused(model_path: str) -> None:
    """(FP8 needs a GPU, so the check runs on a config resolved without it.)"""
    config = create_engine_config(model=model_path, **{**ENGINE, "batch_invariant": False})
    config.model_config.quantization = "fp8"
    config.model_config.batch_invariant = True
    with pytest.raises(ConfigError, match="quantization 'fp8'"):
        check_batch_invariant(config)


def test_refused_architectures_are_named(tmp_path) -> None:
    path = str(tmp_path / "mixtral")
    save_random_checkpoint(
        MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128),
        path,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="MixtralForCausalLM"):
        create_engine_config(model=path, **ENGINE)


def test_the_mode_reaches_every_kernel(model_path: str) -> None:
    """Cascade off; every linear layer and the LM head built batch-invariant; attention metadata
    builders that never split (their metadata carries the fixed tiles). With the mode off, none of it."""
    for enabled in (True, False):
        llm = LLM(model=model_path, **{**ENGINE, "batch_invariant": enabled})
        assert llm.llm_engine.config.scheduler_config.disable_cascade_attn == enabled
        runner = llm.llm_engine.engine_core.executor.worker.model_runner
        linears = [m.quant_method for m in runner.model.modules() if hasattr(m, "quant_method")]
        assert linears and all(method.batch_invariant == enabled for method in linears)
        assert runner.model.lm_head.batch_invariant == enabled
        assert all(builder.batch_invariant == enabled for builder in runner.attn_metadata_builders)
        llm.shutdown()
