"""`pagoda bench latency`: decode time per output token at batch 1 and 32, and prefill time
(time to the first token) of a 1k and an 8k prompt, end to end through `LLM.generate`, each
beside its floor: bytes read over the copy bandwidth and FLOPs over the matmul rate, both
measured on the same device in the same run (see `roofline`).

Decode per token = (time of N output tokens - time of 1 output token) / (N - 1), the median
of `--repeats` runs each, so prefill and per-request costs cancel. Prefix caching is off:
every run computes its prompt. `--peer hf` runs HF transformers `generate` with a static
cache (greedy, the same prompts and token counts) in the same process after Pagoda.
With `--speculative-config` every figure is also taken with speculation on, after the plain
engine (see `speculative`), beside the verify step's time against a plain decode step's.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from pagoda import LLM, SamplingParams
from pagoda.benchmarks.cli_args import add_latency_args, numerics_kwargs
from pagoda.benchmarks.hf_peer import free_device_memory, load_hf_model
from pagoda.benchmarks.roofline import (
    ByteWidths,
    DeviceRates,
    ModelShape,
    Work,
    decode_step_work,
    measure_device_rates,
    model_shape,
    prefill_work,
)
from pagoda.benchmarks.speculative import (
    PLAIN,
    SPECULATIVE,
    Acceptance,
    AcceptanceProbe,
    acceptance_probe,
    describe,
    engine_variants,
    speculative_config,
)
from pagoda.config import ConfigError
from pagoda.engine.arg_utils import create_engine_config

# (prompts, output tokens) -> seconds for the whole batch to finish.
GenerateFn = Callable[[list[list[int]], int], float]


@dataclass
class LatencyPlan:
    """What is measured: the prompts of every figure, fixed before any engine runs."""

    batch_sizes: list[int]
    output_len: int
    decode_prompts: list[list[int]]
    prefill_prompts: list[list[int]]
    chunk_size: int
    repeats: int

    def decode_context_lens(self, batch_size: int) -> list[int]:
        """Keys each request attends over in the average timed decode step: the timed steps
        are the N - 1 after the prefill, step k attending over prompt_len + k keys."""
        return [len(p) + self.output_len // 2 for p in self.decode_prompts[:batch_size]]


@dataclass
class Figure:
    name: str
    work: Work
    floor_ms: float
    ms: dict[str, float] = field(default_factory=dict)


def make_plan(args: argparse.Namespace, vocab_size: int, max_model_len: int, max_num_seqs: int) -> LatencyPlan:
    if args.output_len < 2:
        raise ConfigError(f"--output-len must be >= 2 (decode time is taken over N - 1 tokens), got {args.output_len}")
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
    if min(args.batch_sizes) < 1 or max(args.batch_sizes) > max_num_seqs:
        raise ConfigError(f"--batch-sizes must be in [1, {max_num_seqs}] (max_num_seqs), got {args.batch_sizes}")
    if args.prompt_len + args.output_len > max_model_len:
        raise ConfigError(
            f"--prompt-len + --output-len must be <= max_model_len ({max_model_len}), "
            f"got {args.prompt_len + args.output_len}"
        )
    if min(args.prefill_lens) < 1 or max(args.prefill_lens) + 1 > max_model_len:
        raise ConfigError(
            f"--prefill-lens must be in [1, {max_model_len - 1}] (max_model_len - 1), got {args.prefill_lens}"
        )
    rng = random.Random(args.seed)
    id_limit = min(vocab_size, 10000)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(id_limit) for _ in range(length)]

    return LatencyPlan(
        batch_sizes=args.batch_sizes,
        output_len=args.output_len,
        decode_prompts=[prompt(args.prompt_len) for _ in range(max(args.batch_sizes))],
        prefill_prompts=[prompt(length) for length in args.prefill_lens],
        chunk_size=args.max_num_batched_tokens or max(max(args.prefill_lens), max(args.batch_sizes)),
        repeats=args.repeats,
    )


def decode_name(batch_size: int) -> str:
    return f"decode/token b={batch_size}"


def prefill_name(prompt_len: int) -> str:
    return f"prefill {prompt_len}"


def plan_figures(
    plan: LatencyPlan, shape: ModelShape, widths: ByteWidths, rates: DeviceRates, num_gpus: int = 1
) -> list[Figure]:
    """Each figure's work and its floor, the work split evenly over `num_gpus` GPUs."""
    works = [(decode_name(b), decode_step_work(shape, plan.decode_context_lens(b), widths)) for b in plan.batch_sizes]
    works += [
        (prefill_name(len(p)), prefill_work(shape, len(p), plan.chunk_size, widths)) for p in plan.prefill_prompts
    ]
    return [Figure(name, work, 1000.0 * rates.floor_seconds(work) / num_gpus) for name, work in works]


def _median_seconds(generate: GenerateFn, prompts: list[list[int]], max_tokens: int, repeats: int) -> float:
    """Median of `repeats` timed runs after one untimed run (warm-up, compilation)."""
    generate(prompts, max_tokens)
    return statistics.median(generate(prompts, max_tokens) for _ in range(repeats))


def measure(
    generate: GenerateFn, plan: LatencyPlan, probe: AcceptanceProbe | None = None
) -> tuple[dict[str, float], dict[int, Acceptance]]:
    """Milliseconds of every figure for one engine, and with speculation (`probe`) the
    acceptance of each batch size's decode runs."""
    ms = {}
    acceptance = {}
    for batch_size in plan.batch_sizes:
        prompts = plan.decode_prompts[:batch_size]

        def decode_ms(prompts: list[list[int]] = prompts) -> float:
            first = _median_seconds(generate, prompts, 1, plan.repeats)
            full = _median_seconds(generate, prompts, plan.output_len, plan.repeats)
            return 1000.0 * (full - first) / (plan.output_len - 1)

        if probe is None:
            ms[decode_name(batch_size)] = decode_ms()
        else:
            ms[decode_name(batch_size)], acceptance[batch_size] = probe(decode_ms)
    for prompt in plan.prefill_prompts:
        ms[prefill_name(len(prompt))] = 1000.0 * _median_seconds(generate, [prompt], 1, plan.repeats)
    return ms, acceptance


@dataclass(frozen=True)
class SpeculativeDecode:
    """Decode at one batch size with speculation off and on. The speculating engine's step time
    is its decode time over its steps: each request's N - 1 decode tokens less the drafts it
    accepted (every step but a last one capped by max_tokens verifies drafts, so at batch 1 this
    is the verify step; above it, the mean request's steps)."""

    batch_size: int
    ms_per_token_off: float  # one token per step: also the plain decode step
    ms_per_token_on: float
    verify_step_ms: float
    acceptance: Acceptance

    @classmethod
    def of(cls, batch_size: int, off: float, on: float, acceptance: Acceptance, plan: LatencyPlan) -> SpeculativeDecode:
        full_runs = batch_size * (plan.repeats + 1)  # the untimed run too: the probe counts it
        steps = plan.output_len - 1 - acceptance.num_accepted_tokens / full_runs
        return cls(batch_size, off, on, on * (plan.output_len - 1) / steps, acceptance)

    def as_dict(self) -> dict:
        return {
            "batch_size": self.batch_size,
            "tok_per_s_off": 1000.0 / self.ms_per_token_off,
            "tok_per_s_on": 1000.0 / self.ms_per_token_on,
            "s_per_token_off": self.ms_per_token_off / 1000.0,
            "s_per_token_on": self.ms_per_token_on / 1000.0,
            "speedup": self.ms_per_token_off / self.ms_per_token_on,
            "decode_step_ms": self.ms_per_token_off,
            "verify_step_ms": self.verify_step_ms,
            "verify_over_decode_step": self.verify_step_ms / self.ms_per_token_off,
            **asdict(self.acceptance),
        }


def format_speculation(rows: list[SpeculativeDecode]) -> str:
    header = (
        f"{'batch':>5}{'tok/s off':>11}{'tok/s on':>11}{'speedup':>9}{'decode step ms':>16}{'verify step ms':>16}"
        f"{'x decode':>10}{'accept':>8}{'mean len':>10}  per position"
    )
    lines = [header]
    for row in rows:
        d = row.as_dict()
        positions = " ".join(f"{p:.2f}" for p in row.acceptance.per_position_acceptance)
        lines.append(
            f"{row.batch_size:>5}{d['tok_per_s_off']:>11.1f}{d['tok_per_s_on']:>11.1f}{d['speedup']:>9.2f}"
            f"{row.ms_per_token_off:>16.3f}{row.verify_step_ms:>16.3f}{d['verify_over_decode_step']:>10.2f}"
            f"{row.acceptance.acceptance_rate:>8.3f}{row.acceptance.mean_accepted_length:>10.3f}  {positions}"
        )
    return "\n".join(lines)


def pagoda_generate(llm: LLM) -> GenerateFn:
    def generate(prompts: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
        return elapsed

    return generate


def hf_static_generate(model: torch.nn.Module) -> GenerateFn:
    """HF `generate` with a static KV cache (compiled on CUDA by transformers itself), greedy,
    exactly `max_tokens` new tokens. The prompts of one call have one length: no padding."""

    def generate(prompts: list[list[int]], max_tokens: int) -> float:
        input_ids = torch.tensor(prompts, device=model.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                cache_implementation="static",
                pad_token_id=0,
            )
        out.cpu()
        elapsed = time.perf_counter() - start
        assert out.shape[1] == input_ids.shape[1] + max_tokens
        return elapsed

    return generate


def format_table(figures: list[Figure], engines: list[str]) -> str:
    header = f"{'figure':<22}{'floor ms':>10}" + "".join(f"{name + ' ms':>18}{'x floor':>9}" for name in engines)
    lines = [header]
    for figure in figures:
        line = f"{figure.name:<22}{figure.floor_ms:>10.3f}"
        for name in engines:
            ms = figure.ms[name]
            line += f"{ms:>18.3f}{ms / figure.floor_ms:>9.2f}"
        lines.append(line)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    spec_config = speculative_config(args)
    engine_kwargs = dict(
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=False,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        **numerics_kwargs(args),
    )
    config = create_engine_config(model=args.model, **engine_kwargs)
    model_config = config.model_config
    plan = make_plan(args, model_config.vocab_size, model_config.max_model_len, config.scheduler_config.max_num_seqs)
    engine_kwargs["max_num_batched_tokens"] = plan.chunk_size
    device = torch.device(config.device_config.device)
    dtype = model_config.dtype
    widths = ByteWidths.of(dtype, model_config.quantization, config.cache_config.kv_cache_dtype)

    engines = []
    figures: list[Figure] = []
    acceptance: dict[int, Acceptance] = {}
    for engine, spec in engine_variants(spec_config):
        llm = LLM(model=args.model, speculative_config=spec, **engine_kwargs)
        if not figures:
            # Measured on the same device, with the engine loaded, just before its figures.
            rates = measure_device_rates(device, dtype)
            # Tensor parallelism splits each step's reads and FLOPs across its GPUs; pipeline stages
            # run one after another for a single batch, so they do not lower the floor.
            shape = model_shape(model_config.hf_config)
            figures = plan_figures(plan, shape, widths, rates, args.tensor_parallel_size)
            by_name = {figure.name: figure for figure in figures}
        engine_ms, engine_acceptance = measure(pagoda_generate(llm), plan, acceptance_probe(llm))
        for name, ms in engine_ms.items():
            by_name[name].ms[engine] = ms
        acceptance.update(engine_acceptance)
        engines.append(engine)
        llm.shutdown()
        del llm
        free_device_memory()  # the engine's KV cache and graphs, before the next engine or the peer
    if args.peer == "hf":
        hf_model = load_hf_model(model_config.model, model_config.load_format, dtype, str(device))
        for name, ms in measure(hf_static_generate(hf_model), plan)[0].items():
            by_name[name].ms["hf-static"] = ms
        engines.append("hf-static")
        del hf_model
        free_device_memory()

    chunks = {len(p): math.ceil(len(p) / plan.chunk_size) for p in plan.prefill_prompts}
    print(
        f"model {model_config.model} ({model_config.load_format}), {dtype}, device {device}; "
        f"copy bandwidth {rates.copy_bytes_per_s / 1e9:.1f} GB/s, matmul {rates.matmul_flops_per_s / 1e12:.2f} TFLOP/s"
    )
    print(
        f"decode: prompts of {args.prompt_len} tokens, {plan.output_len} output tokens; prefill: "
        + ", ".join(f"{n} tokens in {c} chunk(s)" for n, c in chunks.items())
        + f" (max_num_batched_tokens {plan.chunk_size}); median of {plan.repeats}"
    )
    print(format_table(figures, engines))
    speculation = [
        SpeculativeDecode.of(b, by_name[decode_name(b)].ms[PLAIN], by_name[decode_name(b)].ms[SPECULATIVE], a, plan)
        for b, a in acceptance.items()
    ]
    if spec_config is not None:
        print(f"speculation ({describe(spec_config)}): per-request decode, {PLAIN} against {SPECULATIVE}")
        print(format_speculation(speculation))
    result = {
        "model": model_config.model,
        "load_format": model_config.load_format,
        "dtype": str(dtype),
        "device": str(device),
        "copy_bytes_per_s": rates.copy_bytes_per_s,
        "matmul_flops_per_s": rates.matmul_flops_per_s,
        "prompt_len": args.prompt_len,
        "output_len": plan.output_len,
        "max_num_batched_tokens": plan.chunk_size,
        "prefill_chunks": chunks,
        "repeats": plan.repeats,
        "figures": [asdict(f) for f in figures],
    }
    if spec_config is not None:
        result["speculation"] = {
            "config": asdict(spec_config),
            "decode": [row.as_dict() for row in speculation],
        }
    if args.result_json:
        with open(args.result_json, "w") as file:
            json.dump(result, file, indent=2)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_latency_args(parser)
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    run(args)


if __name__ == "__main__":
    main()
