"""CPU offload of the KV cache (#17): multi-turn chat TTFT with offload off and on, and the
host-to-device restore bandwidth, in one run.

The workload: `--conversations` chats of `--turns` turns; each turn adds `--turn-tokens`
random user tokens to the chat's history and answers `--answer-tokens` greedy tokens. A turn
of every chat is submitted at once, the next turn when all have answered. The device pool is
sized to hold `--pool-fraction` of all the chats' final contexts, so most of each history is
evicted between its turns: without offload it is recomputed, with offload it is loaded back
from the pinned host pool. TTFT is from a request's submission to its first token, over
turns 2 and later (the first turn has nothing to reuse).

Restore bandwidth: the engine's own loads (bytes over their time on the load stream), and
`BlockCopier.load` alone over `--copier-blocks` blocks (timed with CUDA events, best of 5),
with its save counterpart. Per turn: TTFT p50 off and on, the bytes loaded, and the floor
of that turn's loads alone (bytes over the copier's bandwidth).

Answers: the offload-on run extends each history with the offload-off run's answers, so
both runs see the same prompts and every answer can be compared. Restored KV is the saved
bytes, but the off run recomputes it in other batches, and in bf16 that is not bit-equal:
a greedy answer may take the other branch of a near-tie. So the check reports the answers
equal, the first tokens equal, and the off run's top-2 logprob margin at each divergence:
a wrong block would diverge at clear margins, noise only at near-ties. With
`--batch-invariant` (kernels whose rows do not depend on the batch, nor on chunking or
caching: slower, so for this check rather than the timings) every answer must be equal.

    python benchmarks/kv_offload.py                      # Llama-3.1-8B shape, H200: the issue's figures
    python benchmarks/kv_offload.py --model DIR --device cpu --conversations 4 --turns 3 \
        --turn-tokens 32 --answer-tokens 2 --kv-offload-gib 0.01 --copier-blocks 16   # smoke run
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from pagoda import LLM, SamplingParams
from pagoda.kv_transfer.factory import block_bytes
from pagoda.kv_transfer.offload.copier import BlockCopier


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--load-format", default=None, help="default: dummy for a dummy shape name")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--turn-tokens", type=int, default=1024)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--pool-fraction", type=float, default=0.2)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-offload-gib", type=float, default=72.0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the step budget (default: the engine's); a shorter step frees decoding requests' blocks sooner",
    )
    parser.add_argument("--copier-blocks", type=int, default=512, help="blocks per isolated copier timing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-invariant", action="store_true", help="exact answers check (see above)")
    return parser.parse_args()


def engine_settings(args: argparse.Namespace) -> dict:
    context = args.turns * (args.turn_tokens + args.answer_tokens)
    total_tokens = args.conversations * context
    num_blocks = max(int(args.pool_fraction * total_tokens) // args.block_size, context // args.block_size + 2)
    load_format = args.load_format or ("dummy" if "/" not in args.model else "auto")
    # Batch invariance runs on the Triton attention backend.
    backend = {"attention_backend": "triton"} if args.batch_invariant else {}
    return dict(
        **backend,
        model=args.model,
        load_format=load_format,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_gpu_blocks=num_blocks,
        max_model_len=context + args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        batch_invariant=args.batch_invariant,
        seed=args.seed,
    )


@dataclass
class ChatRun:
    """Per request, in submission order (turn by turn): its turn, TTFT, answer and the top-2
    logprob margin of each answer token; and the wall time at each turn's end."""

    turns: list[int] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    answers: list[list[int]] = field(default_factory=list)
    margins: list[list[float]] = field(default_factory=list)
    turn_walls: list[float] = field(default_factory=list)
    turn_load_bytes: list[int] = field(default_factory=list)


def top2_margins(logprobs: list[dict]) -> list[float]:
    margins = []
    for position in logprobs:
        best = sorted((entry.logprob for entry in position.values()), reverse=True)
        margins.append(best[0] - best[1] if len(best) > 1 else float("inf"))
    return margins


def run_chats(llm: LLM, args: argparse.Namespace, forced: list[list[int]] | None = None) -> ChatRun:
    """Every turn of every chat; with `forced` (another run's answers, in the same order) the
    histories grow by those instead of this run's own."""
    engine = llm.llm_engine
    scheduler = engine.engine_core.scheduler
    rng = random.Random(args.seed)
    vocab = min(engine.engine_core.config.model_config.vocab_size, 30000)
    histories = [[rng.randrange(10, vocab) for _ in range(args.turn_tokens)] for _ in range(args.conversations)]
    params = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens, ignore_eos=True, logprobs=2)
    run = ChatRun()
    started = time.perf_counter()
    for turn in range(args.turns):
        loaded_before = scheduler.make_stats().kv_transfer.load_bytes if scheduler.remote_kv else 0
        submitted = {}
        for c, history in enumerate(histories):
            req_id = engine.add_request(history, params, request_id=f"t{turn}-c{c}")
            submitted[req_id] = (c, time.perf_counter())
        first_token: dict[str, float] = {}
        finished = {}
        while len(finished) < len(submitted):
            for output in engine.step():
                now = time.perf_counter()
                if output.outputs[0].token_ids and output.request_id not in first_token:
                    first_token[output.request_id] = now
                if output.finished:
                    finished[output.request_id] = output.outputs[0]
        for req_id, (c, submitted_at) in submitted.items():
            answer = list(finished[req_id].token_ids)
            run.turns.append(turn)
            run.ttfts.append(first_token[req_id] - submitted_at)
            run.margins.append(top2_margins(finished[req_id].logprobs))
            grows_by = forced[len(run.answers)] if forced is not None else answer
            run.answers.append(answer)
            histories[c] = histories[c] + grows_by + [rng.randrange(10, vocab) for _ in range(args.turn_tokens)]
        run.turn_walls.append(time.perf_counter() - started)
        loaded = scheduler.make_stats().kv_transfer.load_bytes if scheduler.remote_kv else 0
        run.turn_load_bytes.append(loaded - loaded_before)
        print(f"  turn {turn + 1}: {run.turn_walls[-1]:.1f} s", flush=True)
    return run


def compare_answers(reference: ChatRun, run: ChatRun) -> str:
    """How `run`'s answers agree with `reference`'s (the same prompts): see the docstring."""
    pairs = list(zip(reference.answers, run.answers, reference.margins, strict=True))
    equal = sum(a == b for a, b, _ in pairs)
    first = sum(a[:1] == b[:1] for a, b, _ in pairs)
    at_divergence = []
    for a, b, margins in pairs:
        position = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if position is not None:
            at_divergence.append(margins[position])
    all_margins = sorted(m for margins in reference.margins for m in margins)
    text = f"answers equal {equal}/{len(pairs)}, first tokens equal {first}/{len(pairs)}"
    if at_divergence:
        text += (
            f"; off run's top-2 margin at the {len(at_divergence)} divergences: max {max(at_divergence):.4f}, "
            f"median {statistics.median(at_divergence):.4f} (median over all its tokens {all_margins[len(all_margins) // 2]:.4f})"
        )
    return text


def copier_bandwidth(llm: LLM, args: argparse.Namespace) -> tuple[float, float]:
    """GB/s of BlockCopier.load and .save over `--copier-blocks` blocks of the engine's cache."""
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    copier: BlockCopier = runner.kv_connector.copier
    blocks = min(args.copier_blocks, copier.host.shape[0], runner.kv_cache_config.num_blocks - 1)
    slots = list(range(blocks))
    block_ids = list(range(1, blocks + 1))
    figures = {}
    for name, copy in (
        ("load", lambda: copier.load(slots, block_ids)),
        ("save", lambda: copier.save(block_ids, slots)),
    ):
        times = []
        for _ in range(5):
            if copier.on_cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                copy()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                begin = time.perf_counter()
                copy()
                times.append(time.perf_counter() - begin)
        figures[name] = blocks * copier.block_bytes / min(times) / 1e9
    return figures["load"], figures["save"]


def free(llm: LLM) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def p50_by_turn(run: ChatRun, turn: int) -> float:
    return statistics.median(t for t, k in zip(run.ttfts, run.turns, strict=True) if k == turn)


# The runs: offload off, on, and on with kv_offload_prompts_first (decoding requests swapped
# out to the host for waiting prompts).
RUNS = {
    "off": {},
    "on": {"kv_offload_gib": None},
    "on, prompts first": {"kv_offload_gib": None, "kv_offload_prompts_first": True},
}


def report_transfers(llm: LLM, args: argparse.Namespace) -> float:
    """Print the run's transfer figures and the copier's own bandwidth; returns its load GB/s."""
    transfer = llm.llm_engine.engine_core.scheduler.make_stats().kv_transfer
    load_gbs = transfer.load_bytes / transfer.load_seconds / 1e9 if transfer.load_seconds else 0.0
    copier_load, copier_save = copier_bandwidth(llm, args)
    print(
        f"  host hits {transfer.hit_tokens} tokens in {transfer.num_loads} loads, {transfer.load_bytes / 1e9:.2f} GB "
        f"loaded at {load_gbs:.1f} GB/s (engine loads), {transfer.save_bytes / 1e9:.2f} GB saved; "
        f"failures {transfer.num_failed_transfers}"
    )
    print(f"  BlockCopier alone, {args.copier_blocks} blocks: load {copier_load:.1f} GB/s, save {copier_save:.1f} GB/s")
    return copier_load


def main() -> None:
    args = parse_args()
    settings = engine_settings(args)
    runs: dict[str, ChatRun] = {}
    hits = {}
    copier_load = 0.0
    for label, options in RUNS.items():
        extra = {key: args.kv_offload_gib if value is None else value for key, value in options.items()}
        llm = LLM(**settings, **extra)
        config = llm.llm_engine.engine_core.executor.worker.model_runner.kv_cache_config
        print(
            f"offload {label}: {config.num_blocks - 1} device blocks of {block_bytes(config) / 2**20:.2f} MiB "
            f"({(config.num_blocks - 1) * args.block_size} tokens)",
            flush=True,
        )
        runs[label] = run_chats(llm, args, forced=runs["off"].answers if extra else None)
        stats = llm.llm_engine.engine_core.scheduler.make_stats()
        hits[label] = stats.prefix_cache_hits
        print(f"  preemptions {stats.num_preemptions}")
        if extra:
            copier_load = report_transfers(llm, args)
        free(llm)
    off = runs["off"]
    labels = list(RUNS)
    print(
        f"per turn: TTFT p50 ms ({' / '.join(labels)}), GB loaded (on), "
        "floor of those loads alone at the copier's bandwidth; turn 1 has no history: its TTFT is the prefill queue's"
    )
    for turn in range(args.turns):
        load_gb = runs["on"].turn_load_bytes[turn] / 1e9
        floor = f"{load_gb / copier_load * 1e3:.0f} ms" if copier_load else "-"
        p50s = " / ".join(f"{p50_by_turn(runs[label], turn) * 1e3:.0f}" for label in labels)
        print(f"  turn {turn + 1}: {p50s}, {load_gb:.2f} GB, {floor}")
    later = [i for i, turn in enumerate(off.turns) if turn]
    ttfts = {label: [run.ttfts[i] for i in later] for label, run in runs.items()}
    off_p50 = statistics.median(ttfts["off"])
    for label in labels[1:]:
        p50 = statistics.median(ttfts[label])
        p90s = {name: statistics.quantiles(ttfts[name], n=10)[-1] for name in ("off", label)}
        print(
            f"TTFT p50 (turns 2+): off {off_p50 * 1e3:.1f} ms, on{label[2:]} {p50 * 1e3:.1f} ms "
            f"({off_p50 / p50:.2f}x lower); p90: off {p90s['off'] * 1e3:.1f} ms, {p90s[label] * 1e3:.1f} ms; "
            f"wall: off {off.turn_walls[-1]:.1f} s, {runs[label].turn_walls[-1]:.1f} s"
        )
    print(f"device prefix-cache hits (tokens): {', '.join(f'{label} {hits[label]}' for label in labels)}")
    for label in labels[1:]:
        print(f"greedy answers, {label} vs off (same prompts): {compare_answers(off, runs[label])}")


if __name__ == "__main__":
    main()
