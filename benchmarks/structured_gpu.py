"""Structured output on the GPU: nanobench with every request under a grammar that never ends,
beside the same run unconstrained (same prompts, same token counts, same process), and the host
time the grammars take per step (advancing over the sampled ids and filling the masks).

The grammar is an endless JSON list of objects (`[{"id": 12, "name": "ab"}, {...}, ...`, a rule
with no way out): it never terminates nor allows eos, so both runs produce exactly the
workload's tokens.
Dummy weights need a tokenizer for a grammar: pass one with --tokenizer (a directory with
tokenizer.json; the masks cover its vocabulary, the model's extra ids stay masked).

    python benchmarks/structured_gpu.py --model qwen3-0.6b --tokenizer DIR [--num-prompts 256]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections import defaultdict

from pagoda import LLM, SamplingParams, StructuredOutputsParams
from pagoda.benchmarks.throughput import nanobench_workload
from pagoda.structured_output.state import GrammarBatch
from pagoda.worker.gpu_model_runner import GPUModelRunner

ENDLESS_LIST = r"""
root ::= "[" items
items ::= item "," ws items
item ::= "{\"id\": " [0-9]+ ", \"name\": \"" [a-z ]* "\"}"
ws ::= " "?
"""


def _timed(owner: type, name: str, totals: dict[str, float]) -> None:
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of each run")
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()

    totals: dict[str, float] = defaultdict(float)
    steps = defaultdict(int)
    for name in ("accept", "fill_bitmask"):
        _timed(GrammarBatch, name, totals)
    fill_steps = GPUModelRunner._fill_grammar_bitmask

    def counting_fill(self, inputs):
        start = time.perf_counter()
        fill_steps(self, inputs)
        if inputs.sampling_metadata is not None and inputs.sampling_metadata.grammar_bitmask is not None:
            steps["constrained"] += 1
            rows = int(inputs.sampling_metadata.grammar_bitmask.rows.numel())
            steps["rows"] += rows
            steps["max_rows"] = max(steps["max_rows"], rows)
            totals["step_fill_wall"] += time.perf_counter() - start

    GPUModelRunner._fill_grammar_bitmask = counting_fill

    llm = LLM(model=args.model, load_format="dummy", tokenizer=args.tokenizer, device=args.device, dtype="bfloat16")
    workload = nanobench_workload(args.num_prompts)
    plain = workload.sampling_params()
    constraint = StructuredOutputsParams(grammar=ENDLESS_LIST)
    # No ignore_eos under a grammar (refused: a grammar ends with eos); this one never allows eos.
    constrained = [dataclasses.replace(p, structured_outputs=constraint, ignore_eos=False) for p in plain]
    warm = [SamplingParams(max_tokens=16, structured_outputs=constraint)] * 2
    llm.generate(workload.prompts[:2], warm, use_tqdm=False)

    seconds: dict[str, list[float]] = defaultdict(list)
    for _ in range(args.rounds):
        for name, params in (("plain", plain), ("grammar", constrained)):
            for key in totals:
                totals[key] = 0.0
            steps.clear()
            start = time.perf_counter()
            outputs = llm.generate(workload.prompts, params, use_tqdm=False)
            seconds[name].append(time.perf_counter() - start)
            assert sum(len(o.outputs[0].token_ids) for o in outputs) == workload.num_output_tokens, name
            if name == "grammar":
                assert all(o.outputs[0].text.startswith("[{") for o in outputs)
                grammar_totals = dict(totals)
                grammar_steps = dict(steps)
    best = {name: min(values) for name, values in seconds.items()}
    result = {
        "output_tokens": workload.num_output_tokens,
        "seconds": seconds,
        "overhead": best["grammar"] / best["plain"] - 1,
        "constrained_steps": grammar_steps["constrained"],
        "mean_rows_per_step": grammar_steps["rows"] / grammar_steps["constrained"],
        "max_rows_per_step": grammar_steps["max_rows"],
        "host_ms_per_step": {k: 1000 * v / grammar_steps["constrained"] for k, v in grammar_totals.items()},
    }
    print(json.dumps(result, indent=1))
    if args.result_json:
        with open(args.result_json, "w") as file:
            json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
