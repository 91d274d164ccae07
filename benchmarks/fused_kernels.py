"""The decoder's elementwise ops on CUDA: the layers' torch ops against their fused Triton kernels.

Per model shape and token count, each op runs through its layer with the dispatch pinned to one
path, replayed from a CUDA graph (as decode runs in the engine) with
triton.testing.do_bench_cudagraph, so launch overhead is not timed. Ops: the residual add +
RMSNorm (twice a layer), the q/k split with per-head q/k RMSNorm (Qwen3 only) and rotary, and
SiLU-and-mul. The Triton column's GB/s counts the bytes each kernel must move; "layer" sums one
layer's ops and "model" multiplies that by the layer count.

    python benchmarks/fused_kernels.py [--tokens 1 256 8192] [--dtype bf16]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import torch
from triton.testing import do_bench_cudagraph

from pagoda.model import ops
from pagoda.model.layers.activation import SiluAndMul
from pagoda.model.layers.layernorm import RMSNorm
from pagoda.model.layers.rotary import RotaryEmbedding, rotate_qkv

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Shape:
    name: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    num_layers: int
    qk_norm: bool


SHAPES = (
    Shape("qwen3-0.6b", 1024, 16, 8, 128, 3072, 28, qk_norm=True),
    Shape("llama-3.1-8b", 4096, 32, 8, 128, 14336, 32, qk_norm=False),
)


@dataclass(frozen=True)
class Op:
    name: str
    run: Callable[[], object]
    bytes_moved: int  # what the fused kernel reads and writes
    per_layer: int  # times a layer runs it


def make_ops(shape: Shape, num_tokens: int, dtype: torch.dtype) -> list[Op]:
    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, device="cuda").to(dtype)

    item = torch.finfo(dtype).bits // 8
    hidden, head = shape.hidden_size, shape.head_size
    norm = RMSNorm(hidden).to(device="cuda", dtype=dtype)
    x, residual = randn(num_tokens, hidden), randn(num_tokens, hidden)

    q_size, kv_size = shape.num_heads * head, shape.num_kv_heads * head
    qkv = randn(num_tokens, q_size + 2 * kv_size)
    positions = torch.randint(0, 4096, (num_tokens,), device="cuda")
    cos, sin = RotaryEmbedding(head, 4096, 500000.0, {"rope_type": "default"}).to("cuda")(positions)
    qk_norms = None
    if shape.qk_norm:
        qk_norms = (RMSNorm(head).to(device="cuda", dtype=dtype), RMSNorm(head).to(device="cuda", dtype=dtype))
    rotated_bytes = 2 * num_tokens * (q_size + kv_size) * item + 2 * cos.numel() * cos.element_size()

    act = SiluAndMul()
    gate_up = randn(num_tokens, 2 * shape.intermediate_size)
    return [
        Op("add+rmsnorm", lambda: norm(x, residual), 4 * num_tokens * hidden * item, per_layer=2),
        Op(
            "qk-norm+rotary" if shape.qk_norm else "rotary",
            lambda: rotate_qkv(qkv, cos, sin, shape.num_heads, shape.num_kv_heads, head, qk_norms),
            rotated_bytes,
            per_layer=1,
        ),
        Op("silu-and-mul", lambda: act(gate_up), 3 * num_tokens * shape.intermediate_size * item, per_layer=1),
    ]


def time_us(run: Callable[[], object], triton_path: bool) -> float:
    with mock.patch.object(ops, "use_triton", lambda x: triton_path):
        return do_bench_cudagraph(run, rep=20) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 256, 8192])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, {args.dtype}; microseconds per call (CUDA graph replay)")
    print(f"{'shape':<13} {'tokens':>6} {'op':<15} {'torch us':>9} {'triton us':>9} {'speedup':>8} {'triton GB/s':>11}")
    for shape in SHAPES:
        for num_tokens in args.tokens:
            layer_torch = layer_triton = 0.0
            for op in make_ops(shape, num_tokens, dtype):
                torch_us, triton_us = time_us(op.run, False), time_us(op.run, True)
                layer_torch += op.per_layer * torch_us
                layer_triton += op.per_layer * triton_us
                print(
                    f"{shape.name:<13} {num_tokens:>6} {op.name:<15} {torch_us:>9.1f} {triton_us:>9.1f} "
                    f"{torch_us / triton_us:>7.1f}x {op.bytes_moved / triton_us / 1e3:>11.0f}"
                )
            for label, scale in (("layer", 1), (f"model x{shape.num_layers}", shape.num_layers)):
                print(
                    f"{shape.name:<13} {num_tokens:>6} {label:<15} {scale * layer_torch:>9.1f} "
                    f"{scale * layer_triton:>9.1f} {layer_torch / layer_triton:>7.1f}x"
                )
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
