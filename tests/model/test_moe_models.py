"""Qwen3-MoE and Mixtral against Hugging Face transformers, on tiny random checkpoints.

Qwen3-MoE: 3 layers, the middle one dense (`mlp_only_layers`), 8 experts of which each token
takes 2 (softmax, then top 2 renormalized), head_dim unlike hidden / heads. Mixtral: 2 layers, 4
experts, top 2 by logit. Both saved with `save_pretrained` (the published per-expert layout).

In float32 on the CPU with the torch backend: logits within 1e-4 of HF's in a full prefill and
in a mixed step of chunked prefill and decode; the same weights loaded from transformers 5's
stacked layout; each tensor-parallel rank's slice of every expert; dummy weights. Through `LLM`,
greedy tokens equal HF's up to the first step whose top-2 margin is under 1e-3 (on the GPU the
same test runs the Triton kernel).
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_utils import TARGETS, target_settings
from model_utils import (
    allocate_kv_caches,
    assert_greedy_match,
    hf_greedy,
    hf_logits,
    run_step,
    save_random_checkpoint,
)
from transformers import AutoConfig, AutoModelForCausalLM

from pagoda import LLM, SamplingParams
from pagoda.benchmarks.hf_peer import free_device_memory
from pagoda.model.layers.fused_moe import ExpertNames, FusedMoE, SparseMoeBlock
from pagoda.model.loader.dummy import init_dummy_weights
from pagoda.model.loader.model_loader import check_weights_complete
from pagoda.model.models.qwen3_moe import Qwen3MoeForCausalLM

ATOL = RTOL = 1e-4
MIN_MARGIN = 1e-3
NEW_TOKENS = 16
BLOCK_SIZE = 4
VOCAB = 256

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
CONFIGS = {
    "qwen3_moe": dict(
        num_hidden_layers=3,
        mlp_only_layers=[1],
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        head_dim=32,
    ),
    "mixtral": dict(num_hidden_layers=2, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2),
}


def _config(model_type: str):
    return AutoConfig.for_model(model_type, **_COMMON, **CONFIGS[model_type])


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory) -> tuple[str, torch.nn.Module]:
    """(saved model directory, the HF model read back from it)."""
    path = str(tmp_path_factory.mktemp(request.param))
    save_random_checkpoint(_config(request.param), path)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def our_model(checkpoint, load_model) -> torch.nn.Module:
    return load_model(checkpoint[0])


def test_sparse_and_dense_layers(our_model):
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in our_model.model.layers]
    assert sparse == ([True, False, True] if our_model.config.model_type == "qwen3_moe" else [True, True])
    config = AutoConfig.for_model("qwen3_moe", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    assert Qwen3MoeForCausalLM.moe_spec(config).sparse_layers == {1, 5}


def test_prefill_and_mixed_chunked_step_match_hf(checkpoint, our_model):
    """A full prefill of 21 tokens; then request A's prompt (9) with request B's first chunk (6 of
    14), and A's decode with B's second chunk, attending to its cached first chunk."""
    _, hf_model = checkpoint
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (21,), generator=generator)
    kv_caches = allocate_kv_caches(our_model, num_blocks=10, block_size=BLOCK_SIZE)
    ours = run_step(our_model, kv_caches, tokens, [21], [21], [[3, 1, 8, 2, 6, 9]], BLOCK_SIZE)
    ref = hf_logits(hf_model, tokens)
    top2 = ref.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 1e-2, "reference logits too flat for a meaningful check"
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)

    tokens_a, tokens_b = torch.randint(0, VOCAB, (10,), generator=generator), torch.randint(0, VOCAB, (14,))
    tables = [[7, 2, 5], [1, 9, 4, 6]]
    kv_caches = allocate_kv_caches(our_model, num_blocks=10, block_size=BLOCK_SIZE)
    step1 = run_step(our_model, kv_caches, torch.cat([tokens_a[:9], tokens_b[:6]]), [9, 6], [9, 6], tables, BLOCK_SIZE)
    step2 = run_step(
        our_model, kv_caches, torch.cat([tokens_a[9:], tokens_b[6:]]), [1, 8], [10, 14], tables, BLOCK_SIZE
    )
    torch.testing.assert_close(torch.cat([step1[:9], step2[:1]]), hf_logits(hf_model, tokens_a), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(torch.cat([step1[9:], step2[1:]]), hf_logits(hf_model, tokens_b), atol=ATOL, rtol=RTOL)


def test_stacked_layout_loads_the_same_weights(checkpoint, our_model, load_model):
    """transformers 5's in-memory names (`mlp.experts.gate_up_proj` [E, 2I, H], Mixtral's block
    as `mlp`) fill the same parameters and count as every per-expert tensor."""
    path, hf_model = checkpoint
    state = hf_model.state_dict()
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    fresh = load_model(path)
    for param in fresh.parameters():
        param.data.zero_()
    loaded = fresh.load_weights(state.items())
    check_weights_complete(fresh, loaded, "the stacked state dict")
    for (name, ours), (_, theirs) in zip(our_model.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(ours, theirs), name


def test_tensor_parallel_ranks_hold_slices_of_each_expert(checkpoint, parallel_state):
    """Each of 2 ranks holds half of every expert's intermediate dimension; the ranks' partial
    outputs (before the all-reduce) add up to the whole layer's."""
    _, hf_model = checkpoint
    experts_name = "model.layers.0.mlp.experts"
    state = {name: tensor for name, tensor in hf_model.state_dict().items() if name.startswith(experts_name)}
    gate_up, down = state[f"{experts_name}.gate_up_proj"], state[f"{experts_name}.down_proj"]
    num_experts, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    names = ExpertNames("gate_proj", "up_proj", "down_proj")
    x = torch.randn(5, gate_up.shape[2])
    topk_weights, topk_ids = torch.rand(5, 2), torch.randint(0, num_experts, (5, 2), dtype=torch.int32)
    whole = None
    partials = []
    for tp_size in (1, 2):
        for rank in range(tp_size):
            parallel_state(tp_rank=rank, tp_size=tp_size)
            layer = FusedMoE(num_experts, gate_up.shape[2], intermediate, names)
            for e in range(num_experts):  # the published layout, one tensor per expert
                gate, up = gate_up[e].chunk(2)
                layer.weight_loader(layer.w13_weight, gate, (e, "gate"))
                layer.weight_loader(layer.w13_weight, up, (e, "up"))
                layer.weight_loader(layer.w2_weight, down[e], (e, "down"))
            rows = slice(rank * intermediate // tp_size, (rank + 1) * intermediate // tp_size)
            assert torch.equal(
                layer.w13_weight, torch.cat([gate_up[:, :intermediate][:, rows], gate_up[:, intermediate:][:, rows]], 1)
            )
            assert torch.equal(layer.w2_weight, down[:, :, rows])
            out = layer.method.apply(layer, x, topk_weights, topk_ids)
            if tp_size == 1:
                whole = out
            else:
                partials.append(out)
    torch.testing.assert_close(partials[0] + partials[1], whole, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=f"intermediate size {intermediate} in dim 0"):
        layer.weight_loader(layer.w13_weight, torch.zeros(2 * intermediate, x.shape[1]), (0, "gate"))
    with pytest.raises(ValueError, match="expert 9 is out of range"):
        layer.weight_loader(layer.w13_weight, gate, (9, "gate"))


def test_dummy_weights_fill_every_expert(checkpoint, load_model):
    model = load_model(checkpoint[0])
    init_dummy_weights(model, seed=3)
    experts = model.model.layers[0].mlp.experts
    assert experts.w13_weight.abs().max() <= 1e-3 and (experts.w13_weight != 0).all()
    assert not torch.equal(experts.w2_weight[0], experts.w2_weight[1])


# Engine level: through LLM, against HF's own greedy continuation.

ENGINE_TARGETS = [t for t in TARGETS if t.id in ("cpu-torch", "cuda-triton")]


@pytest.mark.parametrize("engine_target", ENGINE_TARGETS)
def test_engine_greedy_matches_hf(checkpoint, engine_target):
    """Six prompts in chunks of at most 16 tokens, batched with each other's decodes."""
    path, hf_model = checkpoint
    llm = LLM(
        model=path,
        max_model_len=128,
        block_size=BLOCK_SIZE,
        num_gpu_blocks=128,
        max_num_batched_tokens=16,
        **target_settings(engine_target),
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(5, 30))] for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    compared = 0
    for prompt, output in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        reference, margins = hf_greedy(hf_model, prompt, NEW_TOKENS)
        compared += assert_greedy_match(output.outputs[0].token_ids, reference, margins, MIN_MARGIN)
    assert compared >= len(prompts) * NEW_TOKENS // 2, "too few confident steps: the test checks nothing"
    llm.llm_engine.check_idle()


# Tensor parallelism through the multiprocess executor, and the published shape on the GPU.

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int, logprobs: int | None = None) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    return [output.outputs[0] for output in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(
    "device",
    [
        pytest.param("cpu", marks=pytest.mark.slow),  # two worker processes over gloo
        pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 GPUs")]),
    ],
)
def test_tp2_matches_one_rank(checkpoint, device):
    """Each rank holds half of every expert and all-reduces the experts' sum once; float32 (on
    the GPU: the Triton kernel, CUDA graphs with the all-reduce captured)."""
    path, _ = checkpoint
    rng = random.Random(1)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 60))] for _ in range(8)]
    outputs = {}
    for tp in (1, 2):
        llm = LLM(path, device=device, dtype="float32", tensor_parallel_size=tp, max_model_len=128, num_gpu_blocks=256)
        outputs[tp] = [out.token_ids for out in _greedy(llm, prompts, 24)]
        llm.shutdown()
    assert outputs[2] == outputs[1]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.serial  # a real model's layer shapes: more than a GPU worker's 8 GiB
def test_qwen3_30b_a3b_shape_serves_with_cuda_graphs():
    """The published shape with dummy weights in bf16: 128 experts of 768 in 48 layers, decode
    from CUDA graphs; the first token's logprob as eager execution computes it."""
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 150000) for _ in range(rng.randint(10, 300))] for _ in range(16)]
    first = {}
    for eager in (False, True):
        llm = LLM("qwen3-30b-a3b", load_format="dummy", max_model_len=1024, enforce_eager=eager)
        outputs = _greedy(llm, prompts, 32, logprobs=1)
        assert all(len(out.token_ids) == 32 for out in outputs)
        first[eager] = [out.logprobs[0][out.token_ids[0]].logprob for out in outputs]
        llm.shutdown()
        del llm
        free_device_memory()  # 61 GB of weights: the second engine needs the first one's memory
    torch.testing.assert_close(torch.tensor(first[False]), torch.tensor(first[True]), atol=0.05, rtol=0)
