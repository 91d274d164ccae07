"""The `pagoda` command: `generate` answers one prompt, `chat` holds a conversation, `serve`
runs the OpenAI-compatible server, `bench` measures one."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from typing import Any

from pagoda.benchmarks.cli_args import add_bench_parser
from pagoda.config import ConfigError
from pagoda.entrypoints.openai.cli_args import add_serve_args
from pagoda.errors import InvalidRequestError
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model", default=None, help="HF directory, .gguf file or dummy shape (default: SmolLM2-135M-Instruct)"
    )
    group.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    group.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    group.add_argument("--device", default="auto", help="auto, cpu or cuda")
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--max-num-seqs", type=int, default=None)
    group.add_argument("--max-num-batched-tokens", type=int, default=None)
    group.add_argument("--block-size", type=int, default=None)
    group.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    group.add_argument("--seed", type=int, default=0, help="engine seed (unseeded requests draw from it)")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, help="ranks splitting each layer")
    group.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None, help="pipeline stages")
    group.add_argument(
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
    }
    for name in (
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "block_size",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "distributed_executor_backend",
    ):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    return kwargs


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256)
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=-1)
    group.add_argument("--sampling-seed", type=int, default=None, help="seed of the request's random draws")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
    )


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

    params = sampling_params(args)  # bad flags fail before the model loads
    llm = LLM(model=args.model, **engine_kwargs(args))
    use_template = not args.no_chat_template and llm.get_tokenizer() is not None and llm.get_tokenizer().chat_template
    prompt = llm.render_chat([{"role": "user", "content": args.prompt}]) if use_template else args.prompt
    for delta in stream_text(llm.stream(prompt, params)):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def run_chat(args: argparse.Namespace) -> int:
    from pagoda import LLM

    params = sampling_params(args)  # bad flags fail before the model loads
    llm = LLM(model=args.model, **engine_kwargs(args))
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
    from pagoda.entrypoints.openai.api_server import run_server

    return run_server(args, engine_kwargs(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="Pagoda, a fast LLM inference engine")
    parser.add_argument("--log-level", default="WARNING")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="stream the answer to one prompt")
    generate.add_argument("prompt")
    generate.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    add_engine_args(generate)
    add_sampling_args(generate)
    generate.set_defaults(func=run_generate)

    chat = commands.add_parser("chat", help="an interactive multi-turn chat")
    chat.add_argument("--system", default=None, help="a system message")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=run_chat)

    serve = commands.add_parser("serve", help="the OpenAI-compatible HTTP server")
    add_serve_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=run_serve)

    add_bench_parser(commands, add_engine_args, engine_kwargs)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ConfigError, InvalidRequestError) as error:
        print(f"pagoda: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
