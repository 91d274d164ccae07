"""Offline throughput on a fixed workload of random token ids, with ignore_eos.

Workloads: `random` (N prompts of random lengths, one output length, greedy) and
`nanobench` (256 requests, prompt lengths uniform in [100, 1024] of ids below 10000,
output lengths uniform in [100, 1024], temperature 0.6, Python `random.seed(0)` drawing
the prompts first, then the output lengths: 133,966 output tokens).

With `--peer hf` the same prompts run through Hugging Face transformers `generate` (one
padded batch, greedy, exactly the same number of new tokens) in the same process, so the
two figures come from the same machine and moment.
"""

from __future__ import annotations

import argparse
import logging
import random
import time
from dataclasses import dataclass

import torch

from pagoda import LLM, SamplingParams
from pagoda.benchmarks.cli_args import add_throughput_args
from pagoda.benchmarks.hf_peer import load_hf_model


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    temperature: float

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def sampling_params(self) -> list[SamplingParams]:
        return [SamplingParams(temperature=self.temperature, max_tokens=n, ignore_eos=True) for n in self.output_lens]


def random_workload(num_prompts: int, min_prompt_len: int, max_prompt_len: int, output_len: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(100, 10000) for _ in range(rng.randint(min_prompt_len, max_prompt_len))]
        for _ in range(num_prompts)
    ]
    return Workload(prompts, [output_len] * num_prompts, temperature=0.0)


def nanobench_workload(num_prompts: int = 256) -> Workload:
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(num_prompts)]
    output_lens = [rng.randint(100, 1024) for _ in range(num_prompts)]
    return Workload(prompts, output_lens, temperature=0.6)


def run_pagoda(llm: LLM, workload: Workload) -> float:
    params = workload.sampling_params()
    llm.generate(workload.prompts[:2], [SamplingParams(max_tokens=16, ignore_eos=True)] * 2, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == workload.num_output_tokens
    return elapsed


def run_hf(model_path: str, load_format: str, workload: Workload, dtype: torch.dtype, device: str) -> float:
    """HF `generate` on one padded batch: needs one output length for all, and greedy."""
    output_len = workload.output_lens[0]
    if set(workload.output_lens) != {output_len} or workload.temperature != 0.0:
        raise ValueError("the HF generate peer runs the greedy fixed-length workload (--workload random)")
    model = load_hf_model(model_path, load_format, dtype).to(device)
    longest = max(len(p) for p in workload.prompts)
    pad = 0
    input_ids = torch.tensor([[pad] * (longest - len(p)) + p for p in workload.prompts], device=device)
    attention_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in workload.prompts], device=device)
    kwargs = dict(
        do_sample=False,
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        pad_token_id=pad,
    )
    with torch.inference_mode():
        model.generate(
            input_ids=input_ids[:2],
            attention_mask=attention_mask[:2],
            **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4},
        )
        start = time.perf_counter()
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        elapsed = time.perf_counter() - start
    assert out.shape[1] - longest == output_len
    return elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_throughput_args(parser)
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    run(args)


def run(args: argparse.Namespace) -> None:
    if args.workload == "nanobench":
        workload = nanobench_workload(args.num_prompts or 256)
    else:
        workload = random_workload(
            args.num_prompts or 32, args.min_prompt_len, args.max_prompt_len, args.output_len, args.seed
        )
    start = time.perf_counter()
    llm = LLM(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        enforce_eager=args.enforce_eager,
    )
    print(f"pagoda startup (load, profile, graphs): {time.perf_counter() - start:.1f} s", flush=True)
    model_config = llm.llm_engine.config.model_config
    device = llm.llm_engine.config.device_config.device
    rows = [("pagoda", run_pagoda(llm, workload))]
    print(f"pagoda: {rows[0][1]:.2f} s", flush=True)
    del llm  # free its KV cache before the peer loads
    if args.peer == "hf":
        hf_seconds = run_hf(model_config.model, model_config.load_format, workload, model_config.dtype, device)
        rows.append(("hf-transformers", hf_seconds))
    print(
        f"workload: {len(workload.prompts)} prompts, {workload.num_prompt_tokens} prompt tokens, "
        f"{workload.num_output_tokens} output tokens; torch threads {torch.get_num_threads()}"
    )
    print(f"{'engine':<16} {'seconds':>8} {'output tok/s':>13} {'total tok/s':>12}")
    for name, seconds in rows:
        total = workload.num_prompt_tokens + workload.num_output_tokens
        print(f"{name:<16} {seconds:>8.2f} {workload.num_output_tokens / seconds:>13.1f} {total / seconds:>12.1f}")


if __name__ == "__main__":
    main()
