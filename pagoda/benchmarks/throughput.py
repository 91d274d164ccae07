"""Offline throughput on a fixed workload of random token ids, with ignore_eos.

Workloads: `random` (N prompts of random lengths, one output length, greedy), `fixed` (the
same with every prompt `--input-len` long: `--input-len 1000 --output-len 1000 --num-prompts
1024` is the 1000/1000 row the peers publish), `nanobench` (256 requests, prompt lengths
uniform in [100, 1024] of ids below 10000, output lengths uniform in [100, 1024], temperature
0.6, Python `random.seed(0)` drawing the prompts first, then the output lengths: 133,966 output
tokens) and `shared-prefix` (N requests, each one of `--num-prefixes` random prefixes of
`--shared-prefix-len` tokens, taken round-robin, then `--suffix-len` random tokens of its own;
one output length, greedy: the system-prompt case cascade attention serves, its floor reading
each prefix once per step).

With `--peer hf` the same prompts run through Hugging Face transformers in the same process,
so the figures come from the same machine and moment: `generate` on one padded batch for
`random` (greedy, exactly the same number of new tokens), its continuous batching for
`nanobench` (each request's own number of new tokens, temperature 0.6). `--peer-num-prompts K`
runs the peer on the first K requests only (the full nanobench takes HF about 4 minutes on an
H200), and Pagoda on those K again, both rows labelled with the subset.

Each row reports the peak number of requests running at once (the scheduler's running list
after each step): what the KV-cache pool and `--max-num-seqs` let the batch reach. Every row
is printed beside the workload's floor (`roofline.workload_floor_seconds`: weight and
KV-cache bytes over the copy bandwidth, or FLOPs over the matmul rate, both measured in the
same run) as a fraction: floor seconds / measured seconds. With `--speculative-config` the
workload runs again with speculation on, after the plain engine (see `speculative`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass

import torch

from pagoda import LLM, SamplingParams
from pagoda.benchmarks.cli_args import add_throughput_args, numerics_kwargs
from pagoda.benchmarks.hf_peer import free_device_memory, load_hf_model
from pagoda.benchmarks.roofline import (
    ByteWidths,
    DeviceRates,
    ModelShape,
    measure_device_rates,
    model_shape,
    shared_prefix_floor_seconds,
    workload_floor_seconds,
)
from pagoda.benchmarks.speculative import (
    PLAIN,
    SPECULATIVE,
    Acceptance,
    acceptance_probe,
    describe,
    engine_variants,
    speculative_config,
)
from pagoda.config import ConfigError, EngineConfig


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    temperature: float
    # Shared-prefix workloads: the prefix length and which prefix each request starts with.
    shared_prefix_len: int = 0
    prefix_ids: list[int] | None = None

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def head(self, num_requests: int) -> Workload:
        """The first `num_requests` requests."""
        return Workload(
            self.prompts[:num_requests],
            self.output_lens[:num_requests],
            self.temperature,
            self.shared_prefix_len,
            self.prefix_ids[:num_requests] if self.prefix_ids is not None else None,
        )

    def sampling_params(self) -> list[SamplingParams]:
        return [SamplingParams(temperature=self.temperature, max_tokens=n, ignore_eos=True) for n in self.output_lens]


def random_workload(num_prompts: int, min_prompt_len: int, max_prompt_len: int, output_len: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(100, 10000) for _ in range(rng.randint(min_prompt_len, max_prompt_len))]
        for _ in range(num_prompts)
    ]
    return Workload(prompts, [output_len] * num_prompts, temperature=0.0)


def shared_prefix_workload(
    num_prompts: int, num_prefixes: int, prefix_len: int, suffix_len: int, output_len: int, seed: int
) -> Workload:
    """Request i starts with prefix i % num_prefixes, then suffix_len ids of its own (ids in
    [100, 10000), as the random workload's)."""
    for name, value, least in (("num_prefixes", num_prefixes, 1), ("shared_prefix_len", prefix_len, 1)):
        if value < least:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {least}, got {value}")
    if suffix_len < 1:
        raise ConfigError(f"--suffix-len must be >= 1, got {suffix_len}")
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 10000) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    prefix_ids = [i % num_prefixes for i in range(num_prompts)]
    prompts = [prefixes[p] + [rng.randrange(100, 10000) for _ in range(suffix_len)] for p in prefix_ids]
    return Workload(prompts, [output_len] * num_prompts, 0.0, prefix_len, prefix_ids)


def nanobench_workload(num_prompts: int = 256) -> Workload:
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(num_prompts)]
    output_lens = [rng.randint(100, 1024) for _ in range(num_prompts)]
    return Workload(prompts, output_lens, temperature=0.6)


def warm_up(llm: LLM, workload: Workload) -> None:
    llm.generate(workload.prompts[:2], [SamplingParams(max_tokens=16, ignore_eos=True)] * 2, use_tqdm=False)


def run_pagoda(llm: LLM, workload: Workload) -> float:
    params = workload.sampling_params()
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == workload.num_output_tokens
    return elapsed


def run_hf_generate(model: torch.nn.Module, workload: Workload) -> float:
    """HF `generate` on one padded batch: needs one output length for all, and greedy."""
    output_len = workload.output_lens[0]
    if set(workload.output_lens) != {output_len} or workload.temperature != 0.0:
        raise ValueError("the HF generate peer runs the greedy fixed-length workload (--workload random)")
    longest = max(len(p) for p in workload.prompts)
    pad = 0
    input_ids = torch.tensor([[pad] * (longest - len(p)) + p for p in workload.prompts], device=model.device)
    attention_mask = torch.tensor(
        [[0] * (longest - len(p)) + [1] * len(p) for p in workload.prompts], device=model.device
    )
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


HF_CB_PAGE_TOKENS = 256  # tokens per KV page of transformers' continuous batching (its default)


def run_hf_continuous_batching(model: torch.nn.Module, workload: Workload) -> float:
    """transformers' `ContinuousBatchingManager` (the API of transformers 5.17 and later): every
    request with its own `max_new_tokens`, EOS disabled (`eos_token_id=-1`, like ignore_eos),
    plain temperature sampling (top-k and top-p off, as in Pagoda's SamplingParams). On CUDA the
    manager sizes its cache and CUDA graphs itself; on the CPU its cache is sized to the workload
    (sizing from free memory there needs psutil and reserves far more than a test needs)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    if workload.temperature > 0:
        sampling = dict(do_sample=True, temperature=workload.temperature, top_k=0, top_p=1.0)
    else:
        sampling = dict(do_sample=False)
    generation_config = GenerationConfig(**sampling, max_new_tokens=max(workload.output_lens), eos_token_id=-1)
    if model.device.type == "cuda":
        cb_config = ContinuousBatchingConfig()
    else:
        pages = sum(
            math.ceil((len(p) + n) / HF_CB_PAGE_TOKENS)
            for p, n in zip(workload.prompts, workload.output_lens, strict=True)
        )
        cb_config = ContinuousBatchingConfig(num_blocks=pages + len(workload.prompts))

    def run_to_completion(manager, prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
        request_ids = [
            manager.add_request(prompt, max_new_tokens=n, eos_token_id=-1)
            for prompt, n in zip(prompts, output_lens, strict=True)
        ]
        finished = {}
        while len(finished) < len(request_ids):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped before finishing")
            elif result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"transformers' continuous batching failed a request: {result.error}")
                finished[result.request_id] = result.generated_tokens
        return [finished[request_id] for request_id in request_ids]

    with model.continuous_batching_context_manager(
        generation_config=generation_config, continuous_batching_config=cb_config, block=True, timeout=5
    ) as manager:
        run_to_completion(manager, workload.prompts[:2], [16, 16])  # warm-up
        start = time.perf_counter()
        outputs = run_to_completion(manager, workload.prompts, workload.output_lens)
        elapsed = time.perf_counter() - start
    assert [len(tokens) for tokens in outputs] == workload.output_lens
    return elapsed


def run_hf(model: torch.nn.Module, workload: Workload) -> tuple[str, float]:
    """The HF peer that fits the workload: one padded `generate` batch for the greedy
    fixed-length one, continuous batching for anything with per-request lengths or sampling."""
    if workload.temperature == 0.0 and len(set(workload.output_lens)) == 1:
        return "hf-generate", run_hf_generate(model, workload)
    return "hf-cb", run_hf_continuous_batching(model, workload)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_throughput_args(parser)
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    run(args)


@dataclass(frozen=True)
class Floor:
    """What a workload's floor on this device takes: its model's shape and the measured rates."""

    shape: ModelShape
    max_num_batched_tokens: int
    widths: ByteWidths
    rates: DeviceRates
    num_gpus: int  # every GPU does its share of the work at once (TP splits each step, PP stages overlap)

    @classmethod
    def measure(cls, config: EngineConfig) -> Floor:
        model_config = config.model_config
        budget = config.scheduler_config.max_num_batched_tokens
        assert budget is not None
        return cls(
            model_shape(model_config.hf_config),
            budget,
            ByteWidths.of(model_config.dtype, model_config.quantization, config.cache_config.kv_cache_dtype),
            measure_device_rates(torch.device(config.device_config.device), model_config.dtype),
            config.parallel_config.world_size,
        )

    def seconds(self, part: Workload) -> float:
        lens = [len(p) for p in part.prompts]
        if part.prefix_ids is not None:
            seconds = shared_prefix_floor_seconds(
                self.shape,
                part.shared_prefix_len,
                len(set(part.prefix_ids)),
                [n - part.shared_prefix_len for n in lens],
                part.output_lens,
                self.max_num_batched_tokens,
                self.widths,
                self.rates,
            )
        else:
            seconds = workload_floor_seconds(
                self.shape, lens, part.output_lens, self.max_num_batched_tokens, self.widths, self.rates
            )
        return seconds / self.num_gpus


@dataclass
class Measurement:
    engine: str
    workload: Workload
    seconds: float
    # The workload's floor on this device (`roofline.workload_floor_seconds`).
    floor_seconds: float
    # What the verify steps accepted, for the speculating engine.
    acceptance: Acceptance | None = None
    # Most requests the scheduler held running after any step of the run.
    peak_running: int = 0

    def as_dict(self) -> dict:
        return {
            "engine": self.engine,
            "requests": len(self.workload.prompts),
            "prompt_tokens": self.workload.num_prompt_tokens,
            "output_tokens": self.workload.num_output_tokens,
            "seconds": self.seconds,
            "output_tok_per_s": self.workload.num_output_tokens / self.seconds,
            "total_tok_per_s": (self.workload.num_prompt_tokens + self.workload.num_output_tokens) / self.seconds,
            "floor_seconds": self.floor_seconds,
            "fraction_of_floor": self.floor_seconds / self.seconds,
            "acceptance": asdict(self.acceptance) if self.acceptance is not None else None,
            "peak_running": self.peak_running,
        }


class PeakRunning:
    """Counts the most requests running after any step of the in-process engine core's scheduler,
    by wrapping its `schedule` (a benchmark's probe; the engine itself keeps no such figure)."""

    def __init__(self, llm: LLM) -> None:
        self.peak = 0
        scheduler = llm.llm_engine.engine_core.scheduler
        schedule = scheduler.schedule

        def counting_schedule(*args, **kwargs):
            output = schedule(*args, **kwargs)
            self.peak = max(self.peak, len(scheduler.running))
            return output

        scheduler.schedule = counting_schedule


def measure_engine(llm: LLM, engine: str, parts: list[Workload], floor: Floor) -> list[Measurement]:
    """Each workload through the loaded engine after one warm-up, with its acceptance if it
    speculates and the peak number of requests running at once."""
    warm_up(llm, parts[0])
    probe = acceptance_probe(llm)
    running = PeakRunning(llm)
    measurements = []
    for part in parts:
        running.peak = 0
        if probe is None:
            seconds, acceptance = run_pagoda(llm, part), None
        else:
            seconds, acceptance = probe(lambda part=part: run_pagoda(llm, part))
        measurements.append(Measurement(engine, part, seconds, floor.seconds(part), acceptance, running.peak))
        print(f"{engine}: {seconds:.2f} s", flush=True)
    return measurements


def format_table(measurements: list[Measurement], num_requests: int) -> str:
    lines = [
        f"{'engine':<14} {'requests':>16} {'output tokens':>13} {'seconds':>8} {'output tok/s':>13} "
        f"{'total tok/s':>12} {'floor s':>8} {'of floor':>9} {'peak running':>12}"
    ]
    for m in measurements:
        row = m.as_dict()
        requests = "all" if row["requests"] == num_requests else f"first {row['requests']}"
        lines.append(
            f"{m.engine:<14} {requests + f' of {num_requests}':>16} {row['output_tokens']:>13} {m.seconds:>8.2f} "
            f"{row['output_tok_per_s']:>13.1f} {row['total_tok_per_s']:>12.1f} {m.floor_seconds:>8.3f} "
            f"{row['fraction_of_floor']:>9.1%} {m.peak_running or '-':>12}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> list[Measurement]:
    if args.workload == "nanobench":
        workload = nanobench_workload(args.num_prompts or 256)
    elif args.workload == "shared-prefix":
        workload = shared_prefix_workload(
            args.num_prompts or 256,
            args.num_prefixes,
            args.shared_prefix_len,
            args.suffix_len,
            args.output_len,
            args.seed,
        )
    elif args.workload == "fixed":
        if args.input_len is None or args.input_len < 1:
            raise ConfigError(f"--workload fixed needs --input-len >= 1, got {args.input_len}")
        workload = random_workload(args.num_prompts or 32, args.input_len, args.input_len, args.output_len, args.seed)
    else:
        workload = random_workload(
            args.num_prompts or 32, args.min_prompt_len, args.max_prompt_len, args.output_len, args.seed
        )
    spec_config = speculative_config(args)
    num_requests = len(workload.prompts)
    if args.peer_num_prompts is not None and not 1 <= args.peer_num_prompts <= num_requests:
        raise ConfigError(f"--peer-num-prompts must be in [1, {num_requests}] (the workload's requests)")
    peer_workload = workload.head(args.peer_num_prompts or num_requests)
    measurements: list[Measurement] = []
    floor: Floor | None = None
    for engine, spec in engine_variants(spec_config):
        start = time.perf_counter()
        llm = LLM(
            model=args.model,
            load_format=args.load_format,
            dtype=args.dtype,
            device=args.device,
            enforce_eager=args.enforce_eager,
            disable_cascade_attn=args.disable_cascade_attn,
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            speculative_config=spec,
            **numerics_kwargs(args),
            **({"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}),
        )
        print(f"{engine} startup (load, profile, graphs): {time.perf_counter() - start:.1f} s", flush=True)
        if floor is None:
            # Measured on the same device, with the engine loaded, just before its run.
            config = llm.llm_engine.config
            floor = Floor.measure(config)
        parts = [workload]
        if args.peer == "hf" and len(peer_workload.prompts) < num_requests:
            parts.append(peer_workload)  # the peer's subset too, so the two compare on the same requests
        measurements += measure_engine(llm, engine, parts, floor)
        llm.shutdown()
        del llm
        free_device_memory()  # the engine's KV cache and graphs, before the next engine or the peer
    assert floor is not None
    model_config, rates = config.model_config, floor.rates
    if args.peer == "hf":
        device = config.device_config.device
        hf_model = load_hf_model(model_config.model, model_config.load_format, model_config.dtype, device)
        engine, seconds = run_hf(hf_model, peer_workload)
        measurements.append(Measurement(engine, peer_workload, seconds, floor.seconds(peer_workload)))
        del hf_model
        free_device_memory()
    shared = ""
    if workload.prefix_ids is not None:
        shared = f" ({len(set(workload.prefix_ids))} shared prefixes of {workload.shared_prefix_len} tokens)"
    print(
        f"workload {args.workload}: {num_requests} prompts{shared}, {workload.num_prompt_tokens} prompt tokens, "
        f"{workload.num_output_tokens} output tokens; torch threads {torch.get_num_threads()}; "
        f"cascade attention {'off' if config.scheduler_config.disable_cascade_attn else 'on'}"
        f"{'; batch-invariant kernels' if args.batch_invariant else ''}"
    )
    print(
        f"floor: bytes over the copy bandwidth ({rates.copy_bytes_per_s / 1e9:.1f} GB/s) or FLOPs over the "
        f"{model_config.dtype} matmul rate ({rates.matmul_flops_per_s / 1e12:.2f} TFLOP/s) per step, all requests "
        f"at once{', each shared prefix prefilled once and its K/V read once per step' if shared else ''}, "
        f"shared by {floor.num_gpus} GPU(s): {measurements[0].floor_seconds:.3f} s = "
        f"{workload.num_output_tokens / measurements[0].floor_seconds:.0f} output tok/s"
    )
    print(format_table(measurements, num_requests))
    result = {
        "workload": args.workload,
        "copy_bytes_per_s": rates.copy_bytes_per_s,
        "matmul_flops_per_s": rates.matmul_flops_per_s,
        "measurements": [m.as_dict() for m in measurements],
    }
    if spec_config is not None:
        plain, speculative = (next(m for m in measurements if m.engine == e) for e in (PLAIN, SPECULATIVE))
        assert speculative.acceptance is not None
        speedup = plain.seconds / speculative.seconds
        print(
            f"speculation ({describe(spec_config)}): {SPECULATIVE} {speedup:.2f}x the output tok/s of {PLAIN}; "
            + speculative.acceptance.summary()
        )
        result["speculation"] = {"config": asdict(spec_config), "speedup": speedup}
    if args.result_json:
        with open(args.result_json, "w") as file:
            json.dump(result, file, indent=2)
    return measurements


if __name__ == "__main__":
    main()
