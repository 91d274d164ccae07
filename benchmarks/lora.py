"""LoRA throughput: output tokens/s of the same requests with adapters and without, in one run.

Three engines' figures over the same requests (random token prompts, greedy, ignore_eos):
  base        an engine without LoRA
  lora-none   an engine with enable_lora (max_loras = the adapter count), no request has an adapter
  lora-mixed  that engine, requests spread round-robin over the random adapters
The adapters are random rank-R PEFT adapters on all seven projections, written to a temporary
folder (no download). Before timing, one short request per adapter fills the slots.

    python benchmarks/lora.py          # Llama-3.1-8B dummy shape, 256 requests, 8 rank-16 adapters

Prints one line per engine (seconds, output tok/s) and lora-mixed's drop against base in %.
"""

from __future__ import annotations

import argparse
import gc
import random
import tempfile
import time

import torch

from pagoda import LLM, LoRARequest, SamplingParams
from pagoda.benchmarks.lora_adapters import write_random_adapter

WARMUP = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


def _prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, vocab_size - 1) for _ in range(args.input_len)] for _ in range(args.num_prompts)]


def _throughput(llm: LLM, prompts: list[list[int]], params: SamplingParams, loras: list | None) -> tuple[float, float]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def _free_device_memory() -> None:
    """After an engine's shutdown and last reference: the next engine sizes its KV cache from what is free."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _base_figures(engine_args: dict, args: argparse.Namespace, params: SamplingParams) -> tuple[float, float]:
    with LLM(**engine_args) as llm:
        prompts = _prompts(args, llm.llm_engine.config.model_config.vocab_size)
        llm.generate(prompts[:2], WARMUP, use_tqdm=False)
        return _throughput(llm, prompts, params, None)


def _lora_figures(
    engine_args: dict, args: argparse.Namespace, params: SamplingParams, folder: str
) -> dict[str, tuple[float, float]]:
    with LLM(**engine_args, enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank) as llm:
        hf_config = llm.llm_engine.config.model_config.hf_config
        adapters = []
        for i in range(args.num_adapters):
            path = f"{folder}/adapter{i}"
            write_random_adapter(path, hf_config, args.rank, seed=i)
            adapters.append(LoRARequest(f"adapter{i}", i + 1, path))
        prompts = _prompts(args, hf_config.vocab_size)
        llm.generate(prompts[: len(adapters)], WARMUP, use_tqdm=False, lora_request=adapters)  # fills the slots
        mixed = [adapters[i % len(adapters)] for i in range(len(prompts))]
        return {
            "lora-none": _throughput(llm, prompts, params, None),
            "lora-mixed": _throughput(llm, prompts, params, mixed),
        }


def run(args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """{engine name: (seconds, output tok/s)}."""
    engine_args = dict(
        model=args.model,
        load_format=args.load_format,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=args.enforce_eager,
    )
    if args.device is not None:
        engine_args["device"] = args.device
    if args.dtype is not None:
        engine_args["dtype"] = args.dtype
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    figures = {"base": _base_figures(engine_args, args, params)}
    _free_device_memory()
    with tempfile.TemporaryDirectory() as folder:
        figures.update(_lora_figures(engine_args, args, params, folder))
    _free_device_memory()
    return figures


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.1-8b", help="a dummy shape name or an HF directory")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    figures = run(args)
    for name, (seconds, tokens_per_s) in figures.items():
        print(f"{name:<11} {seconds:8.2f} s  {tokens_per_s:10.1f} output tok/s")
    drop = 100 * (1 - figures["lora-mixed"][1] / figures["base"][1])
    print(f"lora-mixed vs base: {drop:+.1f}% lower output tok/s ({args.num_adapters} adapters of rank {args.rank})")


if __name__ == "__main__":
    main()
