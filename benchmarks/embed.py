"""Embeddings per second of `LLM.embed` beside the compute floor of the same work.

    python benchmarks/embed.py --model qwen3-0.6b --load-format dummy --num-prompts 10000 --input-len 256

Random token-id prompts of `--input-len` tokens go through `LLM(task="embed")` (last-token
pooling, normalized) in one call; the first `--warmup` prompts run before the timed call. The
floor is the slower of reading the weights once per step (steps of max_num_batched_tokens)
and computing every token's body FLOPs plus its causal attention, at the copy bandwidth and
matmul rate measured on the same device in the same run (pagoda/benchmarks/roofline.py); no
LM head is read or computed. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch

from pagoda import LLM
from pagoda.benchmarks.roofline import (
    ByteWidths,
    Work,
    attention_flops,
    measure_device_rates,
    model_shape,
    weight_bytes_per_step,
)


def embedding_work(hf_config, num_prompts: int, input_len: int, step_tokens: int, widths: ByteWidths) -> Work:
    """Every prompt prefilled whole, steps of `step_tokens` tokens each reading the body once."""
    shape = model_shape(hf_config)
    total = num_prompts * input_len
    steps = math.ceil(total / (step_tokens // input_len * input_len))
    body_bytes = weight_bytes_per_step(shape, 0, widths) - shape.lm_head_params * widths.activation
    return Work(
        bytes_read=steps * body_bytes + total * shape.hidden_size * widths.activation,
        flops=2 * shape.active_body_params * total
        + attention_flops(shape, num_prompts * input_len * (input_len + 1) // 2),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--num-prompts", type=int, default=10000)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=256)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    llm = LLM(
        args.model,
        load_format=args.load_format,
        task="embed",
        device=args.device,
        dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max(args.input_len, 2),
    )
    config = llm.llm_engine.config
    hf_config = config.model_config.hf_config
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, hf_config.vocab_size, (args.num_prompts + args.warmup, args.input_len)).tolist()
    llm.embed(prompts[: args.warmup], use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.embed(prompts[args.warmup :], use_tqdm=False)
    seconds = time.perf_counter() - start
    assert len(outputs) == args.num_prompts

    dtype = config.model_config.dtype
    device = torch.device(config.device_config.device)
    rates = measure_device_rates(device, dtype)
    work = embedding_work(
        hf_config,
        args.num_prompts,
        args.input_len,
        config.scheduler_config.max_num_batched_tokens,
        ByteWidths.of(dtype, config.model_config.quantization, config.cache_config.kv_cache_dtype),
    )
    floor = rates.floor_seconds(work)
    print(
        json.dumps(
            {
                "model": args.model,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "num_prompts": args.num_prompts,
                "input_len": args.input_len,
                "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
                "seconds": round(seconds, 3),
                "embeddings_per_s": round(args.num_prompts / seconds, 1),
                "tokens_per_s": round(args.num_prompts * args.input_len / seconds),
                "floor_seconds": round(floor, 3),
                "floor_embeddings_per_s": round(args.num_prompts / floor, 1),
                "fraction_of_floor": round(floor / seconds, 3),
                "matmul_tflops": round(rates.matmul_flops_per_s / 1e12, 1),
                "copy_gb_per_s": round(rates.copy_bytes_per_s / 1e9, 1),
            }
        )
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
