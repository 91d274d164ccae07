"""One MoE layer's experts on CUDA: the fused MoE Triton kernel against the torch reference, at
decode and prefill token counts, beside the floor of the layer.

Shapes: Qwen3-30B-A3B (128 experts, top 8, H 2048, I 768) and Mixtral-8x7B (8 experts, top 2,
H 4096, I 14336; one layer's experts are 2.8 GB in bf16), Mixtral at TP 2 with `--only`.
Every call routes its own random tokens (a softmax over uniform random logits, then the top
k: what load-balanced routing looks like), so the experts each call reads differ and are not
served from L2. The kernel is timed as the median replay of a CUDA graph of CALLS_PER_GRAPH
calls (launch overhead is not timed); the reference syncs with the host (its expert loop), so
it is timed eagerly, the median of REPEATS calls.

The floor of a call is the slower of reading the weights of the experts its tokens pick
(distinct experts x 3 H I x 2 bytes) at the device's copy bandwidth and computing 2 x 3 H I
FLOPs per (token, expert) at its bf16 matmul rate, both measured in the same run
(`pagoda.benchmarks.roofline`).

    python benchmarks/moe_kernel.py [--tokens 1 8 32 128 1024 8192] [--only qwen3]
    python benchmarks/moe_kernel.py --tune    # candidate block sizes per (shape, tokens); prints
                                              # the best as CONFIG_TABLE rows for triton_fused_moe.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
from triton.runtime.errors import OutOfResources

from pagoda.benchmarks.cuda_timing import graph_time_us
from pagoda.benchmarks.roofline import DeviceRates, Work, measure_device_rates
from pagoda.model.layers.fused_moe import Routing, experts_reference, select_experts
from pagoda.model.ops.triton_fused_moe import GemmConfig, MoeConfig, fused_experts, moe_config

CALLS_PER_GRAPH = 10
REPLAYS = 7
REPEATS = 3
DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
TUNE_TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
# The reference's per-expert loop is slow at large token counts; it is run up to here.
REFERENCE_MAX_TOKENS = 8192
TOLERANCE = 3e-2


@dataclass(frozen=True)
class Shape:
    name: str
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int

    @property
    def expert_bytes(self) -> int:
        return 3 * self.hidden * self.intermediate * 2


SHAPES = (
    Shape("qwen3-30b-a3b", 128, 8, 2048, 768),
    Shape("mixtral-8x7b", 8, 2, 4096, 14336),
    Shape("mixtral-8x7b-tp2", 8, 2, 4096, 7168),
)


@dataclass
class Case:
    """One (shape, tokens): the layer's weights and CALLS_PER_GRAPH routed batches."""

    shape: Shape
    w13: torch.Tensor
    w2: torch.Tensor
    batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

    @property
    def num_tokens(self) -> int:
        return self.batches[0][0].shape[0]

    def work(self) -> Work:
        """Bytes and FLOPs of the average call (distinct experts per batch, averaged)."""
        distinct = statistics.mean(int(ids.unique().numel()) for _, _, ids in self.batches)
        s = self.shape
        return Work(
            bytes_read=round(distinct * s.expert_bytes),
            flops=2 * 3 * s.hidden * s.intermediate * self.num_tokens * s.top_k,
        )

    def time_kernel(self, config: MoeConfig | None = None) -> float:
        return graph_time_us(
            lambda i: fused_experts(*self.args(i), config=config), CALLS_PER_GRAPH, CALLS_PER_GRAPH, REPLAYS
        )

    def time_reference(self) -> float:
        times = []
        for i in range(REPEATS):
            torch.cuda.synchronize()
            start = time.perf_counter()
            experts_reference(*self.args(i % len(self.batches)))
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)

    def args(self, i: int) -> tuple[torch.Tensor, ...]:
        x, weights, ids = self.batches[i]
        return x, self.w13, self.w2, weights, ids


def layer_weights(shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.empty(shape.num_experts, 2 * shape.intermediate, shape.hidden, device="cuda", dtype=torch.bfloat16)
    w2 = torch.empty(shape.num_experts, shape.hidden, shape.intermediate, device="cuda", dtype=torch.bfloat16)
    w13.normal_(0.0, shape.hidden**-0.5)
    w2.normal_(0.0, shape.intermediate**-0.5)
    return w13, w2


def routed_batches(shape: Shape, num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    batches = []
    for _ in range(CALLS_PER_GRAPH):
        x = torch.randn(num_tokens, shape.hidden, device="cuda").to(torch.bfloat16)
        logits = torch.rand(num_tokens, shape.num_experts, device="cuda")
        batches.append((x, *select_experts(logits, Routing(shape.top_k, softmax_first=True, renormalize=True))))
    return batches


def describe(config: MoeConfig) -> str:
    def gemm(c: GemmConfig) -> str:
        return f"{c.block_n}x{c.block_k} g{c.group_m} w{c.num_warps} s{c.num_stages}"

    return f"m{config.block_m} gate_up {gemm(config.gate_up)} | down {gemm(config.down)}"


def compare(shapes: list[Shape], tokens: list[int], rates: DeviceRates) -> None:
    print(
        f"{'shape':<17} {'T':>5} {'experts':>7} {'floor us':>8} {'kernel us':>9} {'of floor':>8} "
        f"{'TB/s':>5} {'TFLOP/s':>7} {'ref us':>9} {'speedup':>7}  config"
    )
    for shape in shapes:
        w13, w2 = layer_weights(shape)
        for num_tokens in tokens:
            case = Case(shape, w13, w2, routed_batches(shape, num_tokens))
            out = fused_experts(*case.args(0))
            reference_us = float("nan")
            if num_tokens <= REFERENCE_MAX_TOKENS:
                expected = experts_reference(*case.args(0))
                if not torch.allclose(out, expected, atol=TOLERANCE, rtol=TOLERANCE):
                    print(f"  {shape.name} T={num_tokens}: the kernel disagrees with the reference")
                reference_us = case.time_reference()
            kernel_us = case.time_kernel()
            work = case.work()
            floor_us = rates.floor_seconds(work) * 1e6
            distinct = work.bytes_read / shape.expert_bytes
            print(
                f"{shape.name:<17} {num_tokens:>5} {distinct:>7.1f} {floor_us:>8.1f} {kernel_us:>9.1f} "
                f"{floor_us / kernel_us:>7.0%} {work.bytes_read / kernel_us / 1e6:>5.2f} "
                f"{work.flops / kernel_us / 1e6:>7.1f} {reference_us:>9.1f} {reference_us / kernel_us:>6.1f}x  "
                f"{describe(moe_config(num_tokens, shape.top_k, shape.num_experts))}"
            )
        del w13, w2
        torch.cuda.empty_cache()


def candidate_gemms() -> list[GemmConfig]:
    configs = []
    for block_n, block_k in ((32, 128), (64, 64), (64, 128), (64, 256), (128, 64), (128, 128)):
        for num_stages in (3, 4):
            for group_m in (1, 8):
                configs.append(GemmConfig(block_n, block_k, group_m, 8 if block_n >= 128 else 4, num_stages))
    return configs


def candidate_block_m(rows_per_expert: float) -> tuple[int, ...]:
    if rows_per_expert <= 4:
        return (16,)
    if rows_per_expert <= 32:
        return (16, 32)
    if rows_per_expert <= 128:
        return (32, 64)
    return (64, 128)


def timed_config(case: Case, expected: torch.Tensor, config: MoeConfig) -> float:
    """Microseconds per call with `config`; inf if it does not fit or disagrees with the reference."""
    try:
        out = fused_experts(*case.args(0), config=config)
    except OutOfResources:
        return float("inf")
    if not torch.allclose(out, expected, atol=TOLERANCE, rtol=TOLERANCE):
        print(f"  {describe(config)} disagrees with the reference: skipped")
        return float("inf")
    return case.time_kernel(config)


def best_config(case: Case, expected: torch.Tensor, table: MoeConfig) -> tuple[float, MoeConfig]:
    """For each candidate block_m: the best gate_up tiling with the table's down tiling, then the
    best down tiling with that; the fastest pair overall (the table's own if nothing beats it)."""
    best = (timed_config(case, expected, table), table)
    shape = case.shape
    for block_m in candidate_block_m(case.num_tokens * shape.top_k / shape.num_experts):
        timed = [(timed_config(case, expected, MoeConfig(block_m, c, table.down)), c) for c in candidate_gemms()]
        gate_up = min(timed, key=lambda result: result[0])[1]
        timed = [(timed_config(case, expected, MoeConfig(block_m, gate_up, c)), c) for c in candidate_gemms()]
        down_us, down = min(timed, key=lambda result: result[0])
        if down_us < best[0]:
            best = (down_us, MoeConfig(block_m, gate_up, down))
    return best


def tune(shapes: list[Shape], tokens: list[int]) -> None:
    print(f"{'shape':<17} {'T':>5} {'rows/E':>6} {'table us':>8} {'best us':>8}  best config")
    for shape in shapes:
        w13, w2 = layer_weights(shape)
        for num_tokens in tokens:
            case = Case(shape, w13, w2, routed_batches(shape, num_tokens))
            table = moe_config(num_tokens, shape.top_k, shape.num_experts)
            expected = experts_reference(*case.args(0))
            table_us = timed_config(case, expected, table)
            best_us, best = best_config(case, expected, table)
            rows_per_expert = num_tokens * shape.top_k / shape.num_experts
            print(
                f"{shape.name:<17} {num_tokens:>5} {rows_per_expert:>6.1f} {table_us:>8.1f} {best_us:>8.1f}  {describe(best)}"
            )
            print(f"    ({rows_per_expert:g}, {best!r}),")
        del w13, w2
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    parser.add_argument("--only", default=None, help="shapes whose name contains this")
    parser.add_argument("--tune", action="store_true", help="sweep block sizes instead of comparing")
    args = parser.parse_args()
    shapes = [s for s in SHAPES if args.only is None or args.only in s.name]
    if args.only is None:
        shapes = shapes[:2]
    torch.manual_seed(0)
    if args.tune:
        tune(shapes, list(args.tokens or TUNE_TOKENS))
        return
    rates = measure_device_rates(torch.device("cuda"), torch.bfloat16)
    print(
        f"copy {rates.copy_bytes_per_s / 1e12:.2f} TB/s (read + write), bf16 matmul {rates.matmul_flops_per_s / 1e12:.0f} TFLOP/s"
    )
    compare(shapes, list(args.tokens or DEFAULT_TOKENS), rates)


if __name__ == "__main__":
    main()
