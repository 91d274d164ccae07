"""NCCL all-reduce against a one-shot all-reduce (PyTorch symmetric memory), one process a GPU.

Tensor parallelism all-reduces each layer's [tokens, hidden] output twice per step; at decode
batch sizes these messages are a few KiB to a few MiB, where latency, not bandwidth, rules.
Each figure is the time of one all-reduce, measured as in a decode step: 64 back-to-back
all-reduces captured in one CUDA graph (no launch overhead), and eagerly, median of 20
replays. One-shot: every rank reads every peer's buffer over NVLink and sums (symmetric
memory, no multicast). Also checks both give the same sum as a reference.

Run on a machine with >= 2 GPUs: python benchmarks/allreduce.py [--world-size N]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagoda.distributed.parallel_state import free_port

HIDDEN = 4096  # Llama-3.1-8B
TOKENS = [1, 4, 16, 64, 256, 1024]
CALLS_PER_GRAPH = 64
REPLAYS = 20


def _time_us(fn, calls: int) -> float:
    """Median over REPLAYS of fn's time divided by `calls`, in microseconds."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def _graph(body) -> torch.cuda.CUDAGraph:
    body()  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            body()
    return graph


def measure(tokens: int, rank: int, device: torch.device, group_name: str, symm_buffer: torch.Tensor | None) -> dict:
    """One message size: both all-reduces' sums checked against a float32 reference, then timed."""
    numel = tokens * HIDDEN
    x = torch.randn(numel, dtype=torch.bfloat16, device=device, generator=torch.Generator(device).manual_seed(rank))
    expected = x.float()
    dist.all_reduce(expected)
    nccl_out = x.clone()
    dist.all_reduce(nccl_out)
    row = {"tokens": tokens, "kib": numel * 2 / 1024, "nccl_ok": torch.allclose(nccl_out.float(), expected, atol=0.05)}
    row["nccl_eager_us"] = _time_us(lambda: dist.all_reduce(nccl_out), 1)
    row["nccl_graph_us"] = _time_us(_graph(lambda: dist.all_reduce(nccl_out)).replay, CALLS_PER_GRAPH)
    if symm_buffer is None:
        return row
    view = symm_buffer[:numel]

    def one_shot() -> torch.Tensor:
        view.copy_(x)
        return torch.ops.symm_mem.one_shot_all_reduce(view, "sum", group_name)

    try:
        row["one_shot_ok"] = torch.allclose(one_shot().float(), expected, atol=0.05)
        row["one_shot_eager_us"] = _time_us(one_shot, 1)
        row["one_shot_graph_us"] = _time_us(_graph(one_shot).replay, CALLS_PER_GRAPH)
    except Exception as e:
        row["one_shot_error"] = f"{type(e).__name__}: {e}"
    return row


def run(rank: int, world_size: int, port: int, results: dict) -> None:
    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, device_id=device
    )
    group_name = dist.group.WORLD.group_name
    symm_buffer, one_shot_error = None, None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm_buffer = symm_mem.empty(max(TOKENS) * HIDDEN, dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(symm_buffer, group_name)
    except Exception as e:
        one_shot_error = f"{type(e).__name__}: {e}"
    rows = [measure(tokens, rank, device, group_name, symm_buffer) for tokens in TOKENS]
    if rank == 0:
        results["rows"] = rows
        results["one_shot_error"] = one_shot_error
    dist.barrier()
    dist.destroy_process_group()


def _cell(row: dict, key: str, width: int) -> str:
    return f"{row[key]:>{width}.1f}" if key in row else f"{'-':>{width}}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-size", type=int, default=torch.cuda.device_count())
    args = parser.parse_args()
    port = free_port()
    results = mp.Manager().dict()
    mp.spawn(run, args=(args.world_size, port, results), nprocs=args.world_size)
    print(
        f"all-reduce of bf16 [tokens, {HIDDEN}] across {args.world_size} GPUs, us per call "
        f"(graph: {CALLS_PER_GRAPH} calls per replay; median of {REPLAYS})"
    )
    print(
        f"{'tokens':>7}{'KiB':>8}{'nccl eager':>12}{'nccl graph':>12}{'1-shot eager':>14}{'1-shot graph':>14}  sums ok"
    )
    for row in results["rows"]:
        ok = f"nccl {row['nccl_ok']}" + (f", one-shot {row['one_shot_ok']}" if "one_shot_ok" in row else "")
        print(
            f"{row['tokens']:>7}{row['kib']:>8.0f}{_cell(row, 'nccl_eager_us', 12)}{_cell(row, 'nccl_graph_us', 12)}"
            f"{_cell(row, 'one_shot_eager_us', 14)}{_cell(row, 'one_shot_graph_us', 14)}  {ok}"
        )
    errors = {results["one_shot_error"], *(row.get("one_shot_error") for row in results["rows"])} - {None}
    for error in errors:
        print("one-shot failed:", error)


if __name__ == "__main__":
    main()
