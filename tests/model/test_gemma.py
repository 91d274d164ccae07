"""Gemma 2 and Gemma 3 (text) against Hugging Face transformers, on tiny random checkpoints.

Gemma 2: 4 layers alternating sliding (window 8) and full attention, attention and final logit
soft-caps. Gemma 3: 6 layers, two sliding to one full, per-head q/k norms, local RoPE (its own
base) and global RoPE (another base, linear scaling), a final logit soft-cap. Both: tied
embeddings, `query_pre_attn_scalar` unlike head_dim, GELU-tanh MLP, four norms per layer.

In float32 on the CPU with the torch backend, our logits are HF's (eager attention, the only one
that soft-caps) within 1e-4 for a prompt 3 windows long, in chunked prefill across the window
and in decode, also split over two pipeline stages; through `LLM`, greedy tokens equal HF's up
to the first step whose top-2 margin is under 1e-3, under chunked prefill across the window,
preemption and a prefix-cache hit.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from model_utils import (
    allocate_kv_caches,
    assert_greedy_match,
    hf_greedy,
    hf_logits,
    run_step,
    save_random_checkpoint,
)
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

from pagoda import LLM, SamplingParams
from pagoda.distributed import parallel_state
from pagoda.model.layers.activation import GeluAndMul
from pagoda.model.layers.layernorm import GemmaRMSNorm
from pagoda.model.models.gemma import FULL, SLIDING, _gemma3_rope_settings

ATOL = RTOL = 1e-4
MIN_MARGIN = 1e-3
NEW_TOKENS = 16
BLOCK_SIZE = 4
WINDOW = 8
VOCAB = 256

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,  # not head_dim: a scale of head_dim ** -0.5 would show
    max_position_embeddings=256,
    sliding_window=WINDOW,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)

CONFIGS = {
    "gemma2": dict(
        model_type="gemma2",
        num_hidden_layers=4,  # layer_types default: sliding, full, sliding, full
        rope_theta=1000.0,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=10.0,
    ),
    "gemma3": dict(
        model_type="gemma3_text",
        num_hidden_layers=6,
        layer_types=[SLIDING, SLIDING, FULL] * 2,
        # the older flat layout, which transformers 5 turns into rope_parameters per layer type
        rope_theta=100000.0,
        rope_local_base_freq=1000.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        final_logit_softcapping=15.0,
    ),
}


def _config(name: str):
    kwargs = {**_COMMON, **CONFIGS[name]}
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory) -> tuple[str, torch.nn.Module]:
    """(saved model directory, the HF model read back from it with eager attention)."""
    path = str(tmp_path_factory.mktemp(request.param))
    save_random_checkpoint(_config(request.param), path)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return path, hf_model.eval()


@pytest.fixture(scope="module")
def our_model(checkpoint, load_model) -> torch.nn.Module:
    return load_model(checkpoint[0])


def test_config_layouts(checkpoint, our_model):
    config = our_model.config
    assert getattr(config, "layer_types", None) is not None
    if config.model_type == "gemma3_text":
        # transformers 5 (both 5.17 and 5.24) keep one RoPE set per layer type...
        assert _gemma3_rope_settings(config, SLIDING) == (1000.0, {"rope_type": "default", "rope_theta": 1000.0})
        theta, scaling = _gemma3_rope_settings(config, FULL)
        assert theta == 100000.0 and scaling["rope_type"] == "linear" and scaling["factor"] == 4.0
        # ... transformers 4 kept them flat, the scaling dict's key possibly "type".
        flat = SimpleNamespace(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"type": "linear", "factor": 8.0})
        assert _gemma3_rope_settings(flat, SLIDING) == (1e4, {"rope_type": "default"})
        assert _gemma3_rope_settings(flat, FULL) == (1e6, {"type": "linear", "factor": 8.0, "rope_type": "linear"})
    windows = [m.sliding_window for name, m in our_model.named_modules() if name.endswith(".attn")]
    assert windows == [WINDOW if t == SLIDING else None for t in config.layer_types]


def test_norm_and_activation_match_hf_in_bfloat16():
    """The cast order shows in bf16: Gemma multiplies by (1 + weight) in float32, then casts."""
    torch.manual_seed(0)
    x, residual = torch.randn(5, 64, dtype=torch.bfloat16), torch.randn(5, 64, dtype=torch.bfloat16)
    ours, hf = GemmaRMSNorm(64, 1e-6).to(torch.bfloat16), Gemma3RMSNorm(64, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        ours.weight.normal_(0.0, 0.5)
        hf.weight.copy_(ours.weight)
        assert torch.equal(ours(x), hf(x))
        normed, summed = ours(x, residual)
        assert torch.equal(summed, x + residual) and torch.equal(normed, hf(x + residual))
    gate, up = torch.randn(5, 96), torch.randn(5, 96)
    expected = torch.nn.functional.gelu(gate, approximate="tanh") * up
    assert torch.equal(GeluAndMul()(torch.cat([gate, up], dim=-1)), expected)


def test_full_prefill_three_windows_long_matches_hf(checkpoint, our_model):
    _, hf_model = checkpoint
    tokens = torch.randint(1, VOCAB, (3 * WINDOW + 3,), generator=torch.Generator().manual_seed(0))
    kv_caches = allocate_kv_caches(our_model, num_blocks=12, block_size=BLOCK_SIZE)
    ours = run_step(our_model, kv_caches, tokens, [len(tokens)], [len(tokens)], [[3, 1, 8, 2, 6, 9, 11]], BLOCK_SIZE)
    ref = hf_logits(hf_model, tokens)
    assert ours.dtype == torch.float32 and ours.shape == (len(tokens), VOCAB)
    top2 = ref.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 1e-2, "reference logits too flat for a meaningful check"
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)


def test_chunked_prefill_and_decode_match_hf(checkpoint, our_model):
    """Request A prefills 30 tokens in chunks of 11, 13 and 6 (each longer than the window, and
    attending to the cached chunks before it), then decodes; request B prefills 20 at once in
    A's first step and decodes alongside A's later chunks."""
    _, hf_model = checkpoint
    generator = torch.Generator().manual_seed(1)
    tokens_a, tokens_b = (
        torch.randint(1, VOCAB, (31,), generator=generator),
        torch.randint(1, VOCAB, (23,), generator=generator),
    )
    blocks_a, blocks_b = [7, 2, 12, 5, 15, 14, 9, 3], [1, 10, 4, 13, 6, 8]
    kv_caches = allocate_kv_caches(our_model, num_blocks=16, block_size=BLOCK_SIZE)
    tables = [blocks_a, blocks_b]
    steps = [  # (A's tokens, B's tokens) computed in each step
        ((0, 11), (0, 20)),
        ((11, 24), (20, 21)),
        ((24, 30), (21, 22)),
        ((30, 31), (22, 23)),
    ]
    out_a, out_b = [], []
    for (a0, a1), (b0, b1) in steps:
        logits = run_step(
            our_model,
            kv_caches,
            torch.cat([tokens_a[a0:a1], tokens_b[b0:b1]]),
            [a1 - a0, b1 - b0],
            [a1, b1],
            tables,
            BLOCK_SIZE,
        )
        out_a.append(logits[: a1 - a0])
        out_b.append(logits[a1 - a0 :])
    torch.testing.assert_close(torch.cat(out_a), hf_logits(hf_model, tokens_a), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(torch.cat(out_b), hf_logits(hf_model, tokens_b), atol=ATOL, rtol=RTOL)


def test_two_pipeline_stages_match_hf(checkpoint, load_model):
    """Stage 0 (the embedding and the first layers) hands its hidden states and residual to
    stage 1 (the rest, the final norm and the tied LM head), in one process."""
    path, hf_model = checkpoint
    stages = []
    try:
        for rank in range(2):
            parallel_state.init_parallel_state(pp_rank=rank, pp_size=2)
            stages.append(load_model(path))
    finally:
        parallel_state.init_parallel_state()
    tokens = torch.randint(1, VOCAB, (2 * WINDOW + 5,), generator=torch.Generator().manual_seed(2))
    kv_caches = [allocate_kv_caches(stage, num_blocks=8, block_size=BLOCK_SIZE) for stage in stages]
    assert not set(kv_caches[0]) & set(kv_caches[1])
    table, n = [[5, 1, 7, 2, 6, 3]], len(tokens)
    intermediate = run_step(stages[0], kv_caches[0], tokens, [n], [n], table, BLOCK_SIZE)
    logits = run_step(stages[1], kv_caches[1], tokens, [n], [n], table, BLOCK_SIZE, intermediate)
    torch.testing.assert_close(logits, hf_logits(hf_model, tokens), atol=ATOL, rtol=RTOL)


# Engine level: through LLM, against HF's own greedy continuation with its own (sliding) cache.


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randint(3 * WINDOW, 5 * WINDOW))] for _ in range(count)]


# What the target (the conftest's `target` fixture: device, backend, async scheduling) leaves open.
ENGINE = {"max_model_len": 128, "block_size": BLOCK_SIZE}


def _check_greedy(llm: LLM, hf_model: torch.nn.Module, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    compared = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        assert len(output.outputs[0].token_ids) == NEW_TOKENS
        reference, margins = hf_greedy(hf_model, prompt, NEW_TOKENS)
        compared += assert_greedy_match(output.outputs[0].token_ids, reference, margins, MIN_MARGIN)
    assert compared >= len(prompts) * NEW_TOKENS // 2, "too few confident steps: the test checks nothing"
    llm.llm_engine.check_idle()


def test_engine_chunked_prefill_and_preemption_match_hf(checkpoint, target):
    """Chunks of at most 12 tokens (1.5 windows), six requests of 3-5 windows and a pool with
    room for about two of them."""
    path, hf_model = checkpoint
    llm = LLM(model=path, num_gpu_blocks=48, max_num_batched_tokens=12, max_num_seqs=6, **ENGINE, **target)
    _check_greedy(llm, hf_model, _prompts(0, count=6))
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0, "the pool was meant to force preemption"


def test_engine_prefix_cache_hit_matches_hf(checkpoint, target):
    path, hf_model = checkpoint
    llm = LLM(model=path, num_gpu_blocks=128, **ENGINE, **target)
    prompt = _prompts(1, count=1)[0]
    _check_greedy(llm, hf_model, [prompt])
    kv_cache_manager = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    hits_before = kv_cache_manager.prefix_cache_hits
    _check_greedy(llm, hf_model, [prompt])  # the same prompt again: its cached blocks in every group
    # every full block but the one holding the last prompt token, which is recomputed
    assert kv_cache_manager.prefix_cache_hits - hits_before == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
