"""The fused Triton kernels (RMSNorm with residual, q/k norm + rotary, SiLU-and-mul) against the
layers' torch ops, their numerical reference.

Each test runs a layer call twice, its dispatch forced to the torch ops and then to the Triton
kernel. With CUDA the same tests run compiled; without it the kernels run under
TRITON_INTERPRET=1 on small shapes, and since the interpreter truncates float32 to bfloat16
(the GPU rounds to nearest) bf16 tolerances there are a few bf16 ulps. The `gpu`-marked tests
add model-sized shapes, where the kernels must agree with the torch ops to rounding: bf16/fp16
results almost all bit-identical, the rotation alone exactly, float32 within 1e-5.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from model_utils import TINY_CONFIGS, allocate_kv_caches, build_attn_metadata, forward_context, randomize_

pytest.importorskip("triton")  # conftest.py turns on its interpreter when there is no GPU

from pagoda.attention.backends.torch_ref import TorchAttentionBackend
from pagoda.model import ops
from pagoda.model.layers import activation, layernorm, rotary
from pagoda.model.layers.activation import SiluAndMul
from pagoda.model.layers.layernorm import RMSNorm
from pagoda.model.layers.rotary import RotaryEmbedding, rotate_qkv
from pagoda.model.models.llama import LlamaForCausalLM
from pagoda.model.models.qwen import Qwen3ForCausalLM
from pagoda.model.ops.triton_activation import silu_and_mul
from pagoda.model.ops.triton_rms_norm import fused_add_rms_norm, rms_norm
from pagoda.model.ops.triton_rotary import qk_norm_rotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# atol = rtol per dtype: float32 differs by the order of a float32 sum; fp16 by a rare 1-ulp
# rounding flip; bf16 also by the interpreter's truncating casts (a few bf16 ulps).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.fixture
def both_paths(monkeypatch) -> Callable[[Callable[[], Any]], tuple[Any, Any]]:
    """Runs a call once through the layers' torch ops and once through their Triton kernels."""

    def run(call: Callable[[], Any]) -> tuple[Any, Any]:
        monkeypatch.setattr(ops, "use_triton", lambda x: False)
        reference = call()
        monkeypatch.setattr(ops, "use_triton", lambda x: True)
        return reference, call()

    return run


def assert_matches(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert ours.dtype == reference.dtype and ours.shape == reference.shape
    tolerance = TOLERANCE[reference.dtype]
    torch.testing.assert_close(ours, reference, atol=tolerance, rtol=tolerance)


def random_norm(size: int, dtype: torch.dtype, eps: float = 1e-6) -> RMSNorm:
    norm = RMSNorm(size, eps).to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    return norm


def rotary_inputs(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qkv, cos, sin): a random projection output and the cos/sin of random positions, the
    last three tokens padding at position 0 as in a CUDA-graph batch."""
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, device=DEVICE).to(dtype)
    positions = torch.randint(0, 4096, (num_tokens,), device=DEVICE)
    positions[-3:] = 0
    rotary = RotaryEmbedding(head_size, 4096, 10000.0, {"rope_type": "default"}).to(DEVICE)
    return qkv, *rotary(positions)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", [64, 96])
def test_rms_norm_matches_torch(both_paths, dtype: torch.dtype, hidden_size: int) -> None:
    """An epsilon near the mean square, so that it counts."""
    norm = random_norm(hidden_size, dtype, eps=1e-2)
    x = (0.2 * torch.randn(7, hidden_size, device=DEVICE)).to(dtype)
    reference, ours = both_paths(lambda: norm(x))
    assert_matches(ours, reference)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_torch_with_its_residual_sum(both_paths, dtype: torch.dtype) -> None:
    """The residual sum (the next layer's residual) is the model-dtype sum, as the torch path rounds it."""
    hidden_size = 96
    norm = random_norm(hidden_size, dtype)
    x = torch.randn(9, hidden_size, device=DEVICE).to(dtype)
    residual = (10 * torch.randn(9, hidden_size, device=DEVICE)).to(dtype)
    (reference, reference_sum), (ours, ours_sum) = both_paths(lambda: norm(x, residual))
    assert_matches(ours, reference)
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        assert_matches(ours_sum, reference_sum)  # the interpreter truncates, the GPU rounds
    else:
        assert torch.equal(ours_sum, reference_sum)


def test_rms_norm_takes_strided_rows_and_leading_dimensions(both_paths) -> None:
    """Rows of a wider buffer (row stride > hidden) and [tokens, heads, head_size] inputs."""
    norm = random_norm(32, torch.float32)
    wide = torch.randn(5, 80, device=DEVICE)
    reference, ours = both_paths(lambda: norm(wide[:, 8:40]))
    assert_matches(ours, reference)
    heads = torch.randn(5, 3, 32, device=DEVICE)
    reference, ours = both_paths(lambda: norm(heads))
    assert ours.shape == (5, 3, 32)
    assert_matches(ours, reference)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 2), (6, 3), (4, 4)])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rotary", "qk-norm-rotary"])
def test_rotate_qkv_matches_torch(
    both_paths, dtype: torch.dtype, head_size: int, num_heads: int, num_kv_heads: int, qk_norm: bool
) -> None:
    qkv, cos, sin = rotary_inputs(7, num_heads, num_kv_heads, head_size, dtype)
    norms = (random_norm(head_size, dtype), random_norm(head_size, dtype, eps=1e-3)) if qk_norm else None
    reference, ours = both_paths(lambda: rotate_qkv(qkv, cos, sin, num_heads, num_kv_heads, head_size, norms))
    for name, ours_part, reference_part in zip("qkv", ours, reference, strict=True):
        assert ours_part.shape == reference_part.shape, name
        assert_matches(ours_part, reference_part)
    v_offset = (num_heads + num_kv_heads) * head_size * qkv.element_size()
    assert ours[2].data_ptr() == qkv.data_ptr() + v_offset, "v must be a view of the projection output"


def test_rotary_in_float32_is_bit_identical_to_torch(both_paths) -> None:
    """Without the norm there is no reduction: the rotation rounds exactly as the torch ops do."""
    qkv, cos, sin = rotary_inputs(11, 4, 2, 64, torch.float32)
    (ref_q, ref_k, _), (q, k, _) = both_paths(lambda: rotate_qkv(qkv, cos, sin, 4, 2, 64))
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [96, 1500])
def test_silu_and_mul_matches_torch(both_paths, dtype: torch.dtype, size: int) -> None:
    """1500 columns span two programs per row, the second partly masked."""
    x = (4 * torch.randn(5, 2 * size, device=DEVICE)).to(dtype)
    reference, ours = both_paths(lambda: SiluAndMul()(x))
    assert_matches(ours, reference)


def test_kernels_accept_zero_tokens() -> None:
    weight = torch.ones(64, device=DEVICE)
    empty = torch.empty(0, 64, device=DEVICE)
    assert rms_norm(empty, weight, 1e-6).shape == (0, 64)
    out, residual = fused_add_rms_norm(empty, empty, weight, 1e-6)
    assert out.shape == residual.shape == (0, 64)
    assert silu_and_mul(empty).shape == (0, 32)
    cos = torch.empty(0, 32, device=DEVICE)
    q, k = qk_norm_rotary(torch.empty(0, 4 * 64, device=DEVICE), cos, cos, 2, 1, 64)
    assert q.shape == (0, 128) and k.shape == (0, 64)


def test_kernels_reject_bad_shapes_by_name() -> None:
    x = torch.randn(3, 64, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(32, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(64, device=DEVICE, dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, torch.randn(3, 32, device=DEVICE), torch.ones(64, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(3, 63, device=DEVICE))
    cos = torch.randn(3, 32, device=DEVICE)
    with pytest.raises(ValueError, match="qkv"):
        qk_norm_rotary(torch.randn(3, 5 * 64, device=DEVICE), cos, cos, 2, 1, 64)
    with pytest.raises(ValueError, match="cos"):
        qk_norm_rotary(torch.randn(3, 4 * 64, device=DEVICE), cos[:2], cos, 2, 1, 64)
    with pytest.raises(ValueError, match="q norm weight"):
        qk_norm_rotary(x.new_zeros(3, 4 * 64), cos, cos, 2, 1, 64, (torch.ones(32, device=DEVICE),) * 2)


def test_layers_pick_the_torch_ops_off_cuda() -> None:
    assert not ops.use_triton(torch.zeros(1))


def tiny_model(name: str, dtype: torch.dtype) -> torch.nn.Module:
    model_class = {"qwen3": Qwen3ForCausalLM, "llama3": LlamaForCausalLM}[name]
    torch.manual_seed(1234)
    model = model_class(TINY_CONFIGS[name], TorchAttentionBackend).to(device=DEVICE, dtype=dtype)
    randomize_(model)
    return model.eval()


def tiny_model_logits(model: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """Logits of a mixed step: a 9-token prefill, an 8-token chunk after 6 cached, and a
    decode, on a fresh KV cache."""
    metadata, positions = build_attn_metadata([9, 8, 1], [9, 14, 5], [[7, 2, 5], [1, 9, 4, 6], [3, 8]], 4)
    device_tensors = ("query_start_loc", "seq_lens", "block_table", "slot_mapping")
    metadata = dataclasses.replace(metadata, **{name: getattr(metadata, name).to(DEVICE) for name in device_tensors})
    kv_caches = {
        name: c.to(DEVICE) for name, c in allocate_kv_caches(model, num_blocks=10, block_size=4, dtype=dtype).items()
    }
    tokens = torch.randint(0, model.config.vocab_size, (18,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return model.compute_logits(
            model(tokens.to(DEVICE), positions.to(DEVICE), forward_context(metadata, kv_caches))
        )


@pytest.fixture
def kernel_calls(monkeypatch) -> list[str]:
    """The names of the Triton kernel wrappers the layers call, in call order."""
    calls: list[str] = []
    for module, name in (
        (layernorm, "rms_norm"),
        (layernorm, "fused_add_rms_norm"),
        (rotary, "qk_norm_rotary"),
        (activation, "silu_and_mul"),
    ):
        kernel = getattr(module, name)

        def spy(*args, _kernel=kernel, _name=name, **kwargs):
            calls.append(_name)
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_tiny_model_forward_with_triton_ops_matches_torch_ops(both_paths, kernel_calls, name: str) -> None:
    """Every layer of a float32 model on its Triton ops: logits within 1e-4, same argmax."""
    model = tiny_model(name, torch.float32)
    reference, ours = both_paths(lambda: tiny_model_logits(model, torch.float32))
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))
    # per layer: input norm (plain in layer 0), q/k rotation, post-attention norm, MLP; then the final norm
    per_layer = ["fused_add_rms_norm", "qk_norm_rotary", "fused_add_rms_norm", "silu_and_mul"]
    assert kernel_calls == ["rms_norm", *per_layer[1:], *per_layer, "fused_add_rms_norm"]


# Model-sized shapes (hidden, heads, kv heads, head size, intermediate): Qwen3-0.6B, Llama-3.1-8B
# and a head size of 64 (SmolLM2-135M).
GPU_SHAPES = [(1024, 16, 8, 128, 3072), (4096, 32, 8, 128, 14336), (576, 9, 3, 64, 1536)]
GPU_TOKENS = [1, 257, 4099]


def assert_mostly_bit_identical(ours: torch.Tensor, reference: torch.Tensor) -> None:
    """float32 within 1e-5; bf16/fp16 within two ulps (a flipped rounding of an intermediate can
    carry into the next product), and all but 1% bit-identical: Triton's faster exp and the sum
    order flip a rounding about once in 10^3 elements at most, a missed or extra rounding step
    in far more."""
    if reference.dtype == torch.float32:
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
        return
    two_ulps = 2.0**-6 if reference.dtype == torch.bfloat16 else 2.0**-9
    torch.testing.assert_close(ours, reference, atol=two_ulps, rtol=two_ulps)
    assert (ours != reference).sum().item() <= 2 + 1e-2 * reference.numel()


@gpu
@needs_cuda
def test_gpu_layers_pick_the_triton_kernels() -> None:
    assert ops.use_triton(torch.zeros(1, device="cuda"))


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=["qwen3-0.6b", "llama-3.1-8b", "smollm2-135m"])
@pytest.mark.parametrize("num_tokens", GPU_TOKENS)
def test_gpu_kernels_match_torch_at_model_shapes(
    both_paths, dtype: torch.dtype, shape: tuple[int, ...], num_tokens: int
) -> None:
    hidden_size, num_heads, num_kv_heads, head_size, intermediate_size = shape
    norm = random_norm(hidden_size, dtype)
    x = torch.randn(num_tokens, hidden_size, device=DEVICE).to(dtype)
    residual = (8 * torch.randn(num_tokens, hidden_size, device=DEVICE)).to(dtype)
    (reference, reference_sum), (ours, ours_sum) = both_paths(lambda: norm(x, residual))
    assert_mostly_bit_identical(ours, reference)
    assert torch.equal(ours_sum, reference_sum)
    reference, ours = both_paths(lambda: norm(x))
    assert_mostly_bit_identical(ours, reference)

    qkv, cos, sin = rotary_inputs(num_tokens, num_heads, num_kv_heads, head_size, dtype)
    reference, ours = both_paths(lambda: rotate_qkv(qkv, cos, sin, num_heads, num_kv_heads, head_size))
    for ours_part, reference_part in zip(ours, reference, strict=True):
        assert torch.equal(ours_part, reference_part)  # no reduction: bit-identical in every dtype
    qk_norms = (random_norm(head_size, dtype), random_norm(head_size, dtype))
    reference, ours = both_paths(lambda: rotate_qkv(qkv, cos, sin, num_heads, num_kv_heads, head_size, qk_norms))
    for ours_part, reference_part in zip(ours, reference, strict=True):
        assert_mostly_bit_identical(ours_part, reference_part)

    gate_up = (4 * torch.randn(num_tokens, 2 * intermediate_size, device=DEVICE)).to(dtype)
    reference, ours = both_paths(lambda: SiluAndMul()(gate_up))
    assert_mostly_bit_identical(ours, reference)


@gpu
@needs_cuda
def test_gpu_kernels_replay_from_a_cuda_graph() -> None:
    """Captured on static buffers, the fused ops recompute from whatever the buffers hold."""
    num_tokens, hidden_size, num_heads, num_kv_heads, head_size = 64, 1024, 16, 8, 128
    dtype = torch.bfloat16
    norm, act = random_norm(hidden_size, dtype), SiluAndMul()
    qk_norms = (random_norm(head_size, dtype), random_norm(head_size, dtype))
    x = torch.zeros(num_tokens, hidden_size, device=DEVICE, dtype=dtype)
    residual = torch.zeros_like(x)
    qkv, cos, sin = (torch.zeros_like(t) for t in rotary_inputs(num_tokens, num_heads, num_kv_heads, head_size, dtype))
    gate_up = torch.zeros(num_tokens, 6144, device=DEVICE, dtype=dtype)

    def step() -> tuple[torch.Tensor, ...]:
        normed, summed = norm(x, residual)
        q, k, _ = rotate_qkv(qkv, cos, sin, num_heads, num_kv_heads, head_size, qk_norms)
        return normed, summed, q, k, act(gate_up)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    for _ in range(2):
        new_qkv, new_cos, new_sin = rotary_inputs(num_tokens, num_heads, num_kv_heads, head_size, dtype)
        for buffer, value in (
            (x, torch.randn_like(x)),
            (residual, torch.randn_like(residual)),
            (qkv, new_qkv),
            (cos, new_cos),
            (sin, new_sin),
            (gate_up, torch.randn_like(gate_up)),
        ):
            buffer.copy_(value)
        graph.replay()
        for replayed, eager in zip(outputs, step(), strict=True):
            assert torch.equal(replayed, eager)
