"""Offline throughput: N prompts of random token ids, fixed output length, ignore_eos.

With `--peer hf` the same prompts run through Hugging Face transformers `generate` (one
padded batch, greedy, exactly the same number of new tokens) in the same process, so the
two figures come from the same machine and moment.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

import torch

from pagoda import LLM, SamplingParams
from pagoda.benchmarks.hf_peer import load_hf_model


@dataclass
class Workload:
    prompts: list[list[int]]
    output_len: int

    @property
    def num_output_tokens(self) -> int:
        return len(self.prompts) * self.output_len

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_workload(num_prompts: int, min_prompt_len: int, max_prompt_len: int, output_len: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(100, 10000) for _ in range(rng.randint(min_prompt_len, max_prompt_len))]
        for _ in range(num_prompts)
    ]
    return Workload(prompts, output_len)


def run_pagoda(llm: LLM, workload: Workload) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=workload.output_len, ignore_eos=True)
    llm.generate(workload.prompts[:2], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == workload.num_output_tokens
    return elapsed


def run_hf(model_path: str, load_format: str, workload: Workload, dtype: torch.dtype, device: str) -> float:
    model = load_hf_model(model_path, load_format, dtype).to(device)
    longest = max(len(p) for p in workload.prompts)
    pad = 0
    input_ids = torch.tensor([[pad] * (longest - len(p)) + p for p in workload.prompts], device=device)
    attention_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in workload.prompts], device=device)
    kwargs = dict(
        do_sample=False,
        max_new_tokens=workload.output_len,
        min_new_tokens=workload.output_len,
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
    assert out.shape[1] - longest == workload.output_len
    return elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--min-prompt-len", type=int, default=32)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peer", choices=["none", "hf"], default="none")
    args = parser.parse_args(argv)

    workload = make_workload(args.num_prompts, args.min_prompt_len, args.max_prompt_len, args.output_len, args.seed)
    llm = LLM(model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device)
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
