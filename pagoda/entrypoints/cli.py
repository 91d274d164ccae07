"""The `pagoda` command: `generate` answers one prompt, `chat` holds a conversation, `serve`
runs the OpenAI-compatible server, `router` fronts a disaggregated-prefill pair of them,
`bench` measures one."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from typing import Any

from pagoda import __version__
from pagoda.benchmarks.cli_args import add_bench_parser
from pagoda.config import ConfigError
from pagoda.entrypoints.openai.cli_args import add_serve_args
from pagoda.entrypoints.router_args import add_router_args
from pagoda.errors import InvalidRequestError
from pagoda.outputs import RequestOutput
from pagoda.process_exit import exit_process
from pagoda.sampling_params import SamplingParams


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every flag's default, unless its help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "default" in help_text or any(action.default is value for value in (None, False, argparse.SUPPRESS)):
            return help_text
        return super()._get_help_string(action)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model", default=None, help="HF directory, .gguf file or dummy shape (default: SmolLM2-135M-Instruct)"
    )
    model.add_argument("--tokenizer", default=None, help="HF directory or .gguf file (default: the model's own)")
    model.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "safetensors", "gguf", "dummy"],
        help="auto: from the path; dummy: random weights",
    )
    model.add_argument(
        "--dtype",
        default="auto",
        help="auto (bfloat16 on CUDA and on CPUs with AVX-512 BF16 or AMX, else float32), float32, float16 or bfloat16",
    )
    model.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults: auto (the model's generation_config.json or GGUF metadata), vllm (none: "
        "neutral defaults) or a folder with a generation_config.json (default: auto)",
    )
    model.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    model.add_argument(
        "--quantization",
        default=None,
        choices=["fp8"],
        help="fp8: FP8 weights, quantized at load from a bf16/fp16 checkpoint (default: as the checkpoint is)",
    )
    model.add_argument(
        "--gguf-weights",
        default=None,
        choices=["auto", "quantized", "blocks", "dequantized"],
        help="a GGUF's Q4_0/Q4_1 linear weights: quantized (kept 4-bit, torch's CPU int4 kernel), blocks (the "
        "file's blocks, Pagoda's AVX2 / AVX-512 kernels, built with the system's C compiler), dequantized (to the model "
        "dtype); auto: quantized for a bfloat16 model on an AVX-512 CPU, else blocks where their kernels build "
        "(default: auto)",
    )
    model.add_argument(
        "--task",
        default="auto",
        choices=["auto", "generate", "embed"],
        help="generate tokens, or embed (pool hidden states; /v1/embeddings); auto: encoders such as BERT embed",
    )
    model.add_argument(
        "--pooler-config",
        default=None,
        metavar="JSON",
        help='an embedding model\'s pooling, e.g. \'{"pooling_type": "MEAN", "normalize": true}\' (default: the model\'s)',
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument("--device", default="auto", help="auto, cpu or cuda")
    engine.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="CPU device: torch compute threads (default: every CPU this process may run on)",
    )
    engine.add_argument("--max-num-seqs", type=int, default=None, help="requests in one batch (default: 256)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens in one step (default: 8192)")
    engine.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block (default: 16)")
    engine.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="fraction of the GPU's memory this engine may use, KV cache included (e.g. 0.4 for each of two "
        "servers sharing one GPU) (default: 0.9)",
    )
    engine.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    engine.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=["auto", "fp8"],
        help="fp8: K/V in e4m3 (twice the tokens per byte) (default: auto, the model dtype)",
    )
    engine.add_argument(
        "--disable-cascade-attn", action="store_true", help="never split attention over shared prefixes (cascade)"
    )
    engine.add_argument(
        "--batch-invariant",
        action="store_true",
        help="batch-invariant kernels: a request's output never depends on the other requests of its steps, "
        "how its prompt was chunked or cached (turns cascade attention off; refuses FP8, MoE and some models)",
    )
    engine.add_argument(
        "--kv-offload-gib",
        type=float,
        default=None,
        help="GiB of pinned host memory keeping KV blocks the device prefix cache evicts, loaded back on a "
        "later hit instead of recomputed (default: 0, off)",
    )
    engine.add_argument(
        "--kv-offload-save-on-finish",
        action="store_true",
        help="with --kv-offload-gib: also copy a request's cached blocks to the host when it ends",
    )
    engine.add_argument(
        "--kv-offload-prompts-first",
        action="store_true",
        help="with --kv-offload-gib: waiting prompts that do not fit swap out decoding requests, whose KV "
        "comes back from the host (lower time to first token, a later next token for the swapped)",
    )
    engine.add_argument(
        "--kv-role",
        default=None,
        choices=["producer", "consumer"],
        help="disaggregated prefill (behind `pagoda router`): a producer prefills and holds the KV for a "
        "consumer, which pulls it and decodes (default: neither)",
    )
    engine.add_argument(
        "--kv-hold-timeout-s",
        type=float,
        default=None,
        help="producer: seconds a prefilled request's KV waits for its pull before it is freed (default: 60)",
    )
    engine.add_argument(
        "--kv-load-timeout-s",
        type=float,
        default=None,
        help="seconds a request waits for its KV to load (offload, a consumer's pull) before it recomputes "
        "(default: 30)",
    )
    engine.add_argument("--seed", type=int, default=0, help="engine seed (unseeded requests draw from it)")
    engine.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' (default: off)',
    )
    lora = parser.add_argument_group("LoRA")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters over the model")
    lora.add_argument("--max-loras", type=int, default=None, help="adapters in one batch (device slots; default: 1)")
    lora.add_argument("--max-lora-rank", type=int, default=None, help="highest adapter rank, up to 64 (default: 16)")
    lora.add_argument(
        "--max-cpu-loras", type=int, default=None, help="adapters kept in CPU memory (default: --max-loras)"
    )
    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=None, help="ranks splitting each layer (default: 1)"
    )
    parallel.add_argument(
        "--pipeline-parallel-size", "-pp", type=int, default=None, help="pipeline stages (default: 1)"
    )
    parallel.add_argument(
        "--distributed-executor-backend",
        choices=["uni", "mp", "ray"],
        default=None,
        help="how ranks run: local processes (mp, the default above one rank) or Ray actors across machines (ray)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "load_format": args.load_format,
        "dtype": args.dtype,
        "device": args.device,
        "seed": args.seed,
        "enable_prefix_caching": not args.no_prefix_caching,
        "disable_cascade_attn": args.disable_cascade_attn,
        "batch_invariant": args.batch_invariant,
        "generation_config": args.generation_config,
        "task": args.task,
    }
    if args.enable_lora:
        kwargs["enable_lora"] = True
    if args.kv_offload_save_on_finish:
        kwargs["kv_offload_save_on_finish"] = True
    if args.kv_offload_prompts_first:
        kwargs["kv_offload_prompts_first"] = True
    for name in (
        "tokenizer",
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "block_size",
        "cpu_threads",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "distributed_executor_backend",
        "speculative_config",
        "pooler_config",
        "quantization",
        "gguf_weights",
        "kv_cache_dtype",
        "max_loras",
        "max_lora_rank",
        "max_cpu_loras",
        "kv_offload_gib",
        "gpu_memory_utilization",
        "kv_role",
        "kv_hold_timeout_s",
        "kv_load_timeout_s",
    ):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    return kwargs


# What `generate` and `chat` use where neither a flag nor the model's generation config says:
# SmolLM2's recommended temperature and top_p, and a mild repetition penalty, so that small
# models answer sensibly instead of looping. The server keeps SamplingParams' neutral defaults.
CLI_SAMPLING_DEFAULTS: dict[str, Any] = {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}
# Flag dest -> SamplingParams field, for the flags whose unset value (None) means "the default".
_SAMPLING_FLAGS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "stop": "stop",
    "sampling_seed": "seed",
}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling", "an unset flag takes the model's generation_config value, if any")
    group.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    group.add_argument("--temperature", type=float, default=None, help="0 is greedy " + _model_default("temperature"))
    group.add_argument("--top-p", type=float, default=None, help="nucleus sampling " + _model_default("top_p"))
    group.add_argument("--top-k", type=int, default=None, help="-1 is off " + _model_default("top_k"))
    group.add_argument("--min-p", type=float, default=None, help="0 is off " + _model_default("min_p"))
    group.add_argument(
        "--repetition-penalty", type=float, default=None, help="1 is off " + _model_default("repetition_penalty")
    )
    group.add_argument("--presence-penalty", type=float, default=None, help="in [-2, 2] (default: 0)")
    group.add_argument("--frequency-penalty", type=float, default=None, help="in [-2, 2] (default: 0)")
    group.add_argument("--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)")
    group.add_argument("--sampling-seed", type=int, default=None, help="seed of the request's draws (default: --seed)")


def _model_default(field: str) -> str:
    fallback = CLI_SAMPLING_DEFAULTS.get(field)
    return f"(default: the model's, else {'off' if fallback is None else format(fallback, 'g')})"


def sampling_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The SamplingParams fields the user's flags set."""
    fields = {field: getattr(args, dest) for dest, field in _SAMPLING_FLAGS.items() if getattr(args, dest) is not None}
    return {"max_tokens": args.max_tokens, **fields}


def sampling_params(args: argparse.Namespace, model_defaults: dict[str, Any] | None = None) -> SamplingParams:
    """Flags over the model's defaults over CLI_SAMPLING_DEFAULTS (without `model_defaults`, before
    the model loads: it checks the flags)."""
    return SamplingParams(**{**CLI_SAMPLING_DEFAULTS, **(model_defaults or {}), **sampling_overrides(args)})


def model_sampling_params(args: argparse.Namespace, llm: Any) -> SamplingParams:
    return sampling_params(args, llm.llm_engine.config.model_config.default_sampling)


def stream_text(outputs: Iterator[RequestOutput]) -> Iterator[str]:
    """Text deltas of one request's cumulative outputs."""
    printed = 0
    for output in outputs:
        text = output.outputs[0].text
        if len(text) > printed:
            yield text[printed:]
            printed = len(text)


def run_generate(args: argparse.Namespace) -> int:
    from pagoda import LLM

    sampling_params(args)  # bad flags fail before the model loads
    llm = LLM(model=args.model, **engine_kwargs(args))
    params = model_sampling_params(args, llm)
    use_template = not args.no_chat_template and llm.get_tokenizer() is not None and llm.get_tokenizer().chat_template
    prompt = llm.render_chat([{"role": "user", "content": args.prompt}]) if use_template else args.prompt
    for delta in stream_text(llm.stream(prompt, params)):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def run_chat(args: argparse.Namespace) -> int:
    from pagoda import LLM

    sampling_params(args)  # bad flags fail before the model loads
    llm = LLM(model=args.model, **engine_kwargs(args))
    params = model_sampling_params(args, llm)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("Chatting with the model. An empty line or Ctrl-D ends the chat.", file=sys.stderr)
    while True:
        try:
            user = input("you> ")
        except EOFError:
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        sys.stdout.write("assistant> ")
        answer = ""
        for delta in stream_text(llm.stream(llm.render_chat(messages), params)):
            answer += delta
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": answer})
    return 0


def run_serve(args: argparse.Namespace) -> int:
    """Check what needs no model (port, model given once) first; then start the engine core and
    build this process's config, tokenizer and app. A core that forks (`core_start_method`: on
    the CPU) starts once this process has imported the server and built the config, so torch,
    transformers and the engine are imported once for both (benchmarks/RESULTS.md: a third less
    CPU a start, and sooner ready); elsewhere it is spawned first, from the arguments, and
    imports and loads while this process imports the server (ready in 6.9 s instead of 8.7 s
    on two cores, measured with the core spawned after)."""
    from pagoda.engine.core_client import EngineCoreClient, core_start_method
    from pagoda.entrypoints.openai.cli_args import check_serve_args

    check_serve_args(args)
    kwargs = {
        "model": args.model,
        "max_num_queued_requests": args.max_num_queued_requests,
        "enable_sleep_mode": args.enable_sleep_mode,
        **engine_kwargs(args),
    }
    spawned_first = None if core_start_method(kwargs.get("device")) == "fork" else EngineCoreClient(kwargs)
    try:
        from pagoda.engine.arg_utils import create_engine_config
        from pagoda.entrypoints.openai.api_server import run_server

        config = create_engine_config(**kwargs)
    except BaseException:
        if spawned_first is not None:
            spawned_first.shutdown()
        raise
    return run_server(args, config, spawned_first or EngineCoreClient(config))


def add_global_args(parser: argparse.ArgumentParser, default: Any = "INFO") -> None:
    """Flags every command takes, before or after its name: the subcommands' copies default to
    SUPPRESS, so they set the value only when given there."""
    parser.add_argument("--log-level", default=default, help="DEBUG, INFO, WARNING or ERROR (default: INFO)")


def add_global_args_to_subcommands(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                add_global_args(subparser, default=argparse.SUPPRESS)
                add_global_args_to_subcommands(subparser)


def run_router_command(args: argparse.Namespace) -> int:
    from pagoda.entrypoints.router import run_router

    return run_router(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="Pagoda, a fast LLM inference engine")
    parser.add_argument("--version", action="version", version=f"pagoda {__version__}")
    add_global_args(parser)
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="stream the answer to one prompt", formatter_class=HelpFormatter)
    generate.add_argument("prompt", help="the user's message (or raw text with --no-chat-template)")
    generate.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    add_engine_args(generate)
    add_sampling_args(generate)
    generate.set_defaults(func=run_generate)

    chat = commands.add_parser("chat", help="an interactive multi-turn chat", formatter_class=HelpFormatter)
    chat.add_argument("--system", default=None, help="a system message")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=run_chat)

    serve = commands.add_parser("serve", help="the OpenAI-compatible HTTP server", formatter_class=HelpFormatter)
    serve.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="the model, as --model (give one of the two)"
    )
    add_serve_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=run_serve)

    router = commands.add_parser(
        "router", help="the proxy for disaggregated prefill (a producer and a consumer)", formatter_class=HelpFormatter
    )
    add_router_args(router)
    router.set_defaults(func=run_router_command)

    add_bench_parser(commands, add_engine_args, engine_kwargs)
    add_global_args_to_subcommands(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ConfigError, InvalidRequestError) as error:
        print(f"pagoda: error: {error}", file=sys.stderr)
        return 2


def run() -> None:
    """The `pagoda` command: `main`, then the process ends without the interpreter's teardown
    (see `pagoda.process_exit`); `main` itself returns, for callers in a process of their own."""
    exit_process(main())


if __name__ == "__main__":
    run()
