"""Structured output on the GPU: nanobench with every request under a JSON schema that never
ends, beside the same run unconstrained (same prompts, same token counts, same process), with
the grammars' host time per step and how much of it the forward hid.

The schema is an array of at least 100,000 objects (`{"id": 123, "name": "ab", "active": true,
"tags": ["a"]}`, compiled by xgrammar's JSON-schema compiler with fixed separators): no output
of the workload (at most 1,024 tokens) reaches its end, so the grammar never allows eos and
both runs produce exactly the workload's tokens (ignore_eos is refused under a grammar).

Per constrained step, from the runner's `GrammarPipeline.stats`: on the pipeline's thread
`wait_ids` (waiting for the previous step's ids), `advance` (matchers over them), `prefill`
(their next masks); on the step loop `join_wait` (blocked on the thread: the part not hidden),
`fill` (masks the thread could not fill ahead) and `send` (staging the copy); `overlap` is the
share of the thread's work the loop did not wait for.

`--host-only` measures the masks' cost at a fixed batch (default 256) without a model: the same
schema's matchers advanced over tokens drawn from their own masks, one step at a time, and on
CUDA the mask kernel on [batch, vocab] logits.

`--pipeline` runs `GrammarPipeline` steps at a fixed batch without a model, the loop busy for
`--busy-ms` between steps (pure Python and small torch ops, as scheduling and input prep are)
while the thread's job runs: the job's wall time and the loop's work in that time show what
each loses to the other over the GIL (`loop_work`: busy iterations a step; more is better).

    python benchmarks/structured_gpu.py --model qwen3-0.6b --tokenizer DIR [--num-prompts 256]
    python benchmarks/structured_gpu.py --tokenizer DIR --host-only [--batch 256] [--threads 1]
    python benchmarks/structured_gpu.py --tokenizer DIR --pipeline [--batch 131] [--busy-ms 3]

Dummy weights need a tokenizer for a grammar: pass one with --tokenizer (a directory with
tokenizer.json; the masks cover the tokenizer's vocabulary, the mask pass refuses the model's ids
past it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict

import numpy as np
import torch

ENDLESS_SCHEMA = {
    "type": "array",
    "minItems": 100_000,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99_999},
            "name": {"type": "string", "maxLength": 12},
            "active": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["id", "name", "active", "tags"],
    },
}


def end_to_end(args: argparse.Namespace) -> dict:
    from pagoda import LLM, SamplingParams, StructuredOutputsParams
    from pagoda.benchmarks.throughput import nanobench_workload
    from pagoda.structured_output.pipeline import PipelineStats
    from pagoda.structured_output.state import GrammarBatch
    from pagoda.worker.gpu_model_runner import GPUModelRunner

    steps = defaultdict(int)
    execute = GPUModelRunner.execute_model

    def counting_execute(self, *a, **kw):
        steps["steps"] += 1
        return execute(self, *a, **kw)

    GPUModelRunner.execute_model = counting_execute

    llm = LLM(
        model=args.model, load_format=args.load_format, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype
    )
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    workload = nanobench_workload(args.num_prompts)
    plain = workload.sampling_params()
    constraint = StructuredOutputsParams(json=ENDLESS_SCHEMA)
    constrained = [dataclasses.replace(p, structured_outputs=constraint, ignore_eos=False) for p in plain]
    warm = [SamplingParams(max_tokens=16, structured_outputs=constraint)] * 2
    llm.generate(workload.prompts[:2], warm, use_tqdm=False)
    if args.threads or args.min_rows_per_thread:  # the pipeline exists once a grammar has run
        runner._grammar_pipeline.batch = GrammarBatch(args.threads, args.min_rows_per_thread)
    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    if args.sample_at_once:
        runner.defers_sampling = False

    seconds: dict[str, list[float]] = defaultdict(list)
    num_steps: dict[str, int] = {}
    grammar_stats = PipelineStats()
    for _ in range(args.rounds):
        for name, params in (("plain", plain), ("grammar", constrained)):
            steps.clear()
            if name == "grammar":
                runner._grammar_pipeline.stats = PipelineStats()
            start = time.perf_counter()
            outputs = llm.generate(workload.prompts, params, use_tqdm=False)
            seconds[name].append(time.perf_counter() - start)
            num_steps[name] = steps["steps"]
            assert sum(len(o.outputs[0].token_ids) for o in outputs) == workload.num_output_tokens, name
            if name == "grammar":
                assert all(o.outputs[0].text.startswith("[{") for o in outputs)
                grammar_stats = runner._grammar_pipeline.stats
    best = {name: min(values) for name, values in seconds.items()}
    stats = grammar_stats
    return {
        "output_tokens": workload.num_output_tokens,
        "seconds": dict(seconds),
        "overhead": best["grammar"] / best["plain"] - 1,
        "steps": num_steps,
        "ms_per_step": {name: 1000 * best[name] / num_steps[name] for name in best},
        "constrained_steps": stats.steps,
        "mean_rows_per_step": stats.rows / max(stats.steps, 1),
        "max_rows_per_step": stats.max_rows,
        "prefilled_share": stats.prefilled_rows / max(stats.rows, 1),
        "host_ms_per_step": stats.per_step_ms(),
        "min_rows_per_thread": runner._grammar_pipeline.batch.min_rows_per_thread,
        "threads": len(runner._grammar_pipeline.batch._batches),
        "switch_interval_ms": 1000 * sys.getswitchinterval(),
        "defers_sampling": runner.defers_sampling,
    }


def schema_states(args: argparse.Namespace) -> tuple:
    """The backend over `args.tokenizer`, the model's vocabulary, and `args.batch` fresh states of the schema."""
    from transformers import AutoTokenizer

    from pagoda.structured_output.backend import GrammarBackend
    from pagoda.structured_output.spec import GrammarSpec
    from pagoda.structured_output.state import GrammarState

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab_size = args.vocab_size or len(tokenizer)
    backend = GrammarBackend(tokenizer, vocab_size, [tokenizer.eos_token_id])
    compiled = backend.compile(GrammarSpec("json", json.dumps(ENDLESS_SCHEMA)))
    return backend, vocab_size, [GrammarState(compiled) for _ in range(args.batch)]


def pick_allowed(bitmask, vocab_size: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, 1] one token per row of a host bitmask, drawn from those it allows."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return np.array([[int(rng.choice(np.flatnonzero(row)))] for row in bits])


def pipeline_steps(args: argparse.Namespace) -> dict:
    """`GrammarPipeline` steps as the runner makes them (masks, sample, advance), the loop busy
    for `args.busy_ms` after each advance while the job runs; medians over the steps."""
    from pagoda.structured_output.pipeline import GrammarPipeline, MaskRequest, PipelineStats, SampledGrammarRow
    from pagoda.structured_output.state import GrammarBatch

    backend, _, states = schema_states(args)
    device = torch.device(args.device if torch.cuda.is_available() else "cpu")
    pipeline = GrammarPipeline(
        2 * args.batch, backend.mask_vocab_size, device, GrammarBatch(args.threads, args.min_rows_per_thread)
    )
    rng = np.random.default_rng(0)
    small = torch.zeros(64)
    counts = dict.fromkeys(range(64), 0)

    def busy() -> int:
        end, iterations = time.perf_counter() + args.busy_ms / 1000, 0
        while time.perf_counter() < end:
            for key in counts:
                counts[key] += 1
            small.add_(1)
            iterations += 1
        return iterations

    loop_work, masks_ms = [], []
    for step in range(args.host_steps):
        if step == 5:  # the first steps fill from the schema's start, which every state shares
            pipeline.stats = PipelineStats()
        requests = [MaskRequest(state, i) for i, state in enumerate(states)]
        start = time.perf_counter()
        bitmask = pipeline.masks(requests)
        masks_ms.append(1000 * (time.perf_counter() - start))
        if bitmask.ready is not None:
            bitmask.ready.synchronize()
        words = bitmask.words if bitmask.word_rows is None else bitmask.words[bitmask.word_rows]
        ids = pick_allowed(words.cpu(), backend.mask_vocab_size, rng)
        rows = [SampledGrammarRow(state, i, len(state.accepted)) for i, state in enumerate(states)]
        pipeline.advance(rows, lambda ids=ids: ids)
        loop_work.append(busy())
    pipeline.shutdown()
    stats = pipeline.stats.per_step_ms()
    return {
        "batch": args.batch,
        "busy_ms": args.busy_ms,
        "steps": args.host_steps,
        "loop_work": float(np.median(loop_work[5:])),
        "masks_ms": float(np.median(masks_ms[5:])),
        "job_ms": stats["advance"] + stats["prefill"],
        "host_ms_per_step": stats,
    }


def host_only(args: argparse.Namespace) -> dict:
    """The masks' cost at `args.batch` rows: the schema's states stepped over tokens drawn from
    their own masks; per step the batch advance and fill (the pipeline thread's work)."""
    from pagoda.sample.logits_processing import apply_token_bitmask
    from pagoda.sample.metadata import TokenBitmask
    from pagoda.structured_output.state import GrammarBatch, allocate_bitmask

    backend, vocab_size, states = schema_states(args)
    batch = GrammarBatch(args.threads, args.min_rows_per_thread)
    mask_vocab_size = backend.mask_vocab_size  # the tokenizer's: the model's ids past it are refused
    bitmask = allocate_bitmask(args.batch, mask_vocab_size, pin_memory=False)
    rng = np.random.default_rng(0)
    advance, fill = [], []
    for step in range(args.host_steps):
        start = time.perf_counter()
        batch.fill_bitmask(states, bitmask)
        fill.append(time.perf_counter() - start)
        tokens = pick_allowed(bitmask, mask_vocab_size, rng)[:, 0].tolist()
        start = time.perf_counter()
        batch.accept(states, tokens)
        advance.append(time.perf_counter() - start)
        assert not any(state.failed for state in states), step
    result = {
        "batch": args.batch,
        "vocab_size": vocab_size,
        "mask_vocab_size": mask_vocab_size,
        "threads": len(batch._batches),
        "min_rows_per_thread": batch.min_rows_per_thread,
        "steps": args.host_steps,
        "mean_output_tokens": float(np.mean([len(state.accepted) for state in states])),
        # The first steps fill from the schema's start, which every state shares: left out.
        "advance_ms": 1000 * float(np.median(advance[5:])),
        "fill_ms": 1000 * float(np.median(fill[5:])),
    }
    if torch.cuda.is_available():
        logits = torch.randn(args.batch, vocab_size, device="cuda", dtype=torch.bfloat16)
        mask = TokenBitmask(torch.arange(args.batch, device="cuda"), bitmask.cuda())
        host = bitmask.pin_memory()
        start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for name, work in (
            ("mask_kernel_ms", lambda: apply_token_bitmask(logits, mask)),
            ("mask_copy_ms", lambda: mask.words.copy_(host, non_blocking=True)),
        ):
            work()
            start_event.record()
            for _ in range(20):
                work()
            end_event.record()
            torch.cuda.synchronize()
            result[name] = start_event.elapsed_time(end_event) / 20
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--load-format", default="dummy", help="e.g. auto: a small real checkpoint (a CPU smoke run)")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of each run")
    parser.add_argument("--host-only", action="store_true", help="the masks' cost at --batch rows, no model")
    parser.add_argument("--pipeline", action="store_true", help="GrammarPipeline steps at --batch rows, no model")
    parser.add_argument("--busy-ms", type=float, default=3.0, help="--pipeline: the loop's busy time a step")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--host-steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=None, help="GrammarBatch's threads (default: its own)")
    parser.add_argument(
        "--switch-interval-ms", type=float, default=None, help="the GIL's switch interval (Python's default: 5)"
    )
    parser.add_argument("--min-rows-per-thread", type=int, default=None, help="GrammarBatch's chunk (default: its own)")
    parser.add_argument(
        "--sample-at-once", action="store_true", help="sample each step inside execute_model (no deferred sampling)"
    )
    parser.add_argument("--vocab-size", type=int, default=151_936, help="--host-only: the model's vocabulary")
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    result = pipeline_steps(args) if args.pipeline else host_only(args) if args.host_only else end_to_end(args)
    print(json.dumps(result, indent=1))
    if "overhead" in result:  # the end-to-end run's headline, last
        plain, grammar = result["ms_per_step"]["plain"], result["ms_per_step"]["grammar"]
        print(
            f"grammar overhead {100 * result['overhead']:+.1f}% a step ({plain:.2f} -> {grammar:.2f} ms), "
            f"min_rows_per_thread {result['min_rows_per_thread']}, threads {result['threads']}, "
            f"switch interval {result['switch_interval_ms']:g} ms, "
            f"sampling {'deferred' if result['defers_sampling'] else 'at once'}"
        )
    if args.result_json:
        with open(args.result_json, "w") as file:
            json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
