"""The one-token GEMV without tensor cores (`triton_row_gemv.row_gemv`) swept over its configs
per weight shape, against what one token ran before it: 16-bit weights through cuBLAS
(`F.linear`) and the dot-based Triton GEMV (`triton_gemv.gemv`, its tuned or heuristic
config), FP8 weights through `fp8_gemv`. Times come from CUDA graphs of back-to-back calls
rotating through weight copies that overflow L2 (`cuda_timing.graph_time_us`), as in
`fp8_gemm.py`, whose weight builder this script shares.

Candidates: 2-32 rows per program, 256-2,048 bytes of each row per K step, 16 or 32 bytes of W
per thread per step (which sets the warps), K split 1-16 ways; the three fastest are timed
again with 2-4 pipeline stages. The table gives each shape's best against the old paths; then
the TUNED_CONFIGS rows to paste: every FP8 shape, and the 16-bit shapes where the row kernel
beats both old paths by 3% or more (`ops.linear` sends a token only to those).

    python benchmarks/row_gemv.py [--models llama-3.1-8b qwen3-0.6b] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterator

import torch
import torch.nn.functional as F
import triton
from fp8_gemm import Shape, Weights, make_weights
from triton.runtime.errors import OutOfResources

from pagoda.benchmarks.cuda_timing import graph_time_us
from pagoda.model.ops.triton_fp8_gemm import fp8_gemv
from pagoda.model.ops.triton_gemv import gemv
from pagoda.model.ops.triton_row_gemv import RowGemvConfig, row_gemv

SHAPES = {
    "llama-3.1-8b": (
        Shape("llama8b qkv", 6144, 4096),
        Shape("llama8b o", 4096, 4096),
        Shape("llama8b gate_up", 28672, 4096),
        Shape("llama8b down", 4096, 14336),
        Shape("llama8b lm_head", 128256, 4096),
    ),
    "qwen3-0.6b": (
        Shape("qwen0.6b qkv", 4096, 1024),
        Shape("qwen0.6b o", 1024, 2048),
        Shape("qwen0.6b gate_up", 6144, 1024),
        Shape("qwen0.6b down", 1024, 3072),
        Shape("qwen0.6b lm_head", 151936, 1024),
    ),
}
BLOCK_NS = (2, 4, 8, 16, 32)
ROW_BYTES = (256, 512, 1024, 2048)
THREAD_BYTES = (16, 32)
SPLITS = (1, 2, 4, 8, 16)
STAGES = (2, 3, 4)
# Programs beyond this many per SM gain nothing from a further split of K.
MAX_PROGRAMS_PER_SM = 64
# A 16-bit shape goes to the row kernel only when it beats both old paths by this much.
MIN_GAIN = 0.03


def candidates(n: int, k: int, element_size: int, num_sms: int) -> Iterator[RowGemvConfig]:
    for block_n in BLOCK_NS:
        for row_bytes in ROW_BYTES:
            block_k = row_bytes // element_size
            if block_k > triton.next_power_of_2(k):
                continue
            for thread_bytes in THREAD_BYTES:
                num_warps = block_n * row_bytes // (32 * thread_bytes)
                if num_warps not in (1, 2, 4, 8):
                    continue
                steps = triton.cdiv(k, block_k)
                for split_k in SPLITS:
                    if split_k > steps or (
                        split_k > 1 and triton.cdiv(n, block_n) * split_k > MAX_PROGRAMS_PER_SM * num_sms
                    ):
                        break
                    yield RowGemvConfig(block_n, block_k, split_k, num_warps, num_stages=1)


def sweep_shape(
    shape: Shape, weights: Weights, fp8: bool, num_sms: int
) -> tuple[dict[str, float], float, RowGemvConfig]:
    """Old paths' microseconds by name, and the row kernel's best time and config."""
    x = torch.randn(1, shape.k, device="cuda", dtype=torch.bfloat16)
    copies = len(weights.bf16)
    operands = weights.channel if fp8 else [(w, None) for w in weights.bf16]

    def time(config: RowGemvConfig) -> float:
        return graph_time_us(lambda i: row_gemv(x, *operands[i], config=config), copies)

    if fp8:
        old = {"fp8_gemv": graph_time_us(lambda i: fp8_gemv(x, *weights.channel[i]), copies)}
    else:
        old = {
            "F.linear": graph_time_us(lambda i: F.linear(x, weights.bf16[i]), copies),
            "gemv": graph_time_us(lambda i: gemv(x, weights.bf16[i]), copies),
        }
    results = []
    for config in candidates(shape.n, shape.k, 1 if fp8 else 2, num_sms):
        try:
            results.append((time(config), config))
        except OutOfResources:
            continue
    results.sort(key=lambda result: result[0])
    for _, config in results[:3]:
        for num_stages in STAGES:
            staged = RowGemvConfig(config.block_n, config.block_k, config.split_k, config.num_warps, num_stages)
            try:
                results.append((time(staged), staged))
            except OutOfResources:
                continue
    best_us, best = min(results, key=lambda result: result[0])
    return old, best_us, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--json", default=None, help="also write the TUNED_CONFIGS entries here, as found")
    args = parser.parse_args()
    num_sms = torch.cuda.get_device_properties().multi_processor_count
    print(f"{'shape':<18} {'weight':<6} {'old paths (us)':<34} {'row (us)':>9} {'TB/s':>5} {'gain':>6}  config")
    rows, tuned, gains = [], [], []
    for model in args.models:
        for shape in SHAPES[model]:
            weights = make_weights(shape)
            for fp8 in (False, True):
                if fp8 and shape.name.endswith("lm_head"):
                    continue  # FP8 checkpoints keep the LM head in bf16
                old, row_us, config = sweep_shape(shape, weights, fp8, num_sms)
                best_old = min(old.values())
                gain = best_old / row_us - 1
                gains.append(gain)
                tbps = shape.n * shape.k * (1 if fp8 else 2) / row_us / 1e6
                olds = ", ".join(f"{name} {us:.1f}" for name, us in old.items())
                kind = "fp8" if fp8 else "bf16"
                print(f"{shape.name:<18} {kind:<6} {olds:<34} {row_us:>9.1f} {tbps:>5.2f} {gain:>+6.1%}  {config}")
                if fp8 or gain >= MIN_GAIN:
                    dtype = "torch.float8_e4m3fn" if fp8 else "torch.bfloat16"
                    rows.append(
                        f"    ({shape.n}, {shape.k}, {dtype}): RowGemvConfig({config.block_n}, {config.block_k}, "
                        f"{config.split_k}, {config.num_warps}, {config.num_stages}),  # {shape.name}: "
                        f"{row_us:.1f} us, {tbps:.2f} TB/s, {gain:+.0%} over {min(old, key=old.get)}"
                    )
                    tuned.append({"n": shape.n, "k": shape.k, "dtype": kind, **config.__dict__})
                    if args.json:  # after every shape, so a run cut short keeps what it found
                        with open(args.json, "w") as file:
                            json.dump(tuned, file, indent=1)
            del weights
            torch.cuda.empty_cache()
    print(f"median gain over the old paths: {statistics.median(gains):+.1%}")
    print("TUNED_CONFIGS = {")
    print("\n".join(rows))
    print("}")


if __name__ == "__main__":
    main()
