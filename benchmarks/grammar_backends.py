"""xgrammar vs llguidance on Pagoda's tokenizers: tokenizer setup, compile time, per-step mask fill.

Usage: python benchmarks/grammar_backends.py [--steps 32]

For each tokenizer (SmolLM2's GGUF one, the tests' byte-level one for tiny checkpoints) and
engine: the tokenizer info built once, each schema compiled cold, then batches of 1 and 64
matchers walk random valid paths (a uniformly drawn allowed token each step) while the
bitmask of every row is filled, the work a decode step adds per constrained batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

SCHEMAS = {
    "flat object": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "nested, enums, bounded arrays": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 1000},
            "tags": {
                "type": "array",
                "items": {"type": "string", "enum": ["a", "b", "c"]},
                "minItems": 1,
                "maxItems": 4,
            },
            "owner": {
                "type": "object",
                "properties": {
                    "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
                    "score": {"type": "number"},
                },
                "required": ["email"],
            },
        },
        "required": ["id", "tags", "owner"],
    },
    "$defs and $ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"path": {"type": "array", "items": {"$ref": "#/$defs/point"}}, "closed": {"type": "boolean"}},
        "required": ["path", "closed"],
    },
}
REGEX = r"\d{3}-\d{4}"


def tokenizers() -> dict[str, object]:
    from engine_utils import smollm2_gguf_path
    from structured_output.byte_tokenizer import byte_tokenizer

    from pagoda.model.loader import load_tokenizer

    found = {"tiny checkpoint (byte-level, 256)": byte_tokenizer()}
    path = smollm2_gguf_path()
    if path is not None:
        found["SmolLM2-135M (GGUF, 49,152)"] = load_tokenizer(path, "gguf")
    return found


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def bench_xgrammar(tokenizer, steps: int, rng: np.random.Generator) -> dict[str, float]:
    import xgrammar as xgr

    info, setup = timed(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer)))
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    result = {"tokenizer setup s": setup}
    compiled = {}
    for name, schema in SCHEMAS.items():
        compiled[name], result[f"compile {name} ms"] = timed(
            lambda s=schema: compiler.compile_json_schema(json.dumps(s))
        )
        result[f"compile {name} ms"] *= 1e3
    _, seconds = timed(lambda: compiler.compile_regex(REGEX))
    result["compile regex ms"] = seconds * 1e3
    grammar = compiled["nested, enums, bounded arrays"]
    for batch in (1, 64):
        matchers = [xgr.GrammarMatcher(grammar) for _ in range(batch)]
        bitmask = xgr.allocate_token_bitmask(batch, info.vocab_size)
        fill = 0.0
        for _ in range(steps):
            start = time.perf_counter()
            for row, matcher in enumerate(matchers):
                matcher.fill_next_token_bitmask(bitmask, row)
            fill += time.perf_counter() - start
            for row, matcher in enumerate(matchers):
                if matcher.is_terminated():
                    matcher.reset()
                    continue
                matcher.accept_token(random_allowed(bitmask[row], info.vocab_size, rng))
        result[f"fill batch {batch} ms/step"] = fill / steps * 1e3
    return result


def bench_llguidance(tokenizer, steps: int, rng: np.random.Generator) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    info, setup = timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer)))
    result = {"tokenizer setup s": setup}
    grammars = {}
    for name, schema in SCHEMAS.items():
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        # llguidance compiles lazily: the first matcher and mask are where the work is.
        (_, seconds) = timed(lambda g=grammar: first_mask(llguidance, info, g))
        grammars[name] = grammar
        result[f"compile {name} ms"] = seconds * 1e3
    _, seconds = timed(lambda: first_mask(llguidance, info, llguidance.LLMatcher.grammar_from_regex(REGEX)))
    result["compile regex ms"] = seconds * 1e3
    grammar = grammars["nested, enums, bounded arrays"]
    executor = llguidance.LLExecutor(num_threads=2)
    for batch in (1, 64):
        matchers = [llguidance.LLMatcher(info, grammar) for _ in range(batch)]
        bitmask = llguidance.torch.allocate_token_bitmask(batch, info.vocab_size)
        fill = 0.0
        for _ in range(steps):
            start = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask_par(
                executor, [(m, row) for row, m in enumerate(matchers)], bitmask
            )
            fill += time.perf_counter() - start
            for row, matcher in enumerate(matchers):
                if matcher.is_stopped():
                    matcher.reset()
                    continue
                matcher.consume_token(random_allowed(bitmask[row], info.vocab_size, rng))
        result[f"fill batch {batch} ms/step"] = fill / steps * 1e3
    return result


def first_mask(llguidance, info, grammar) -> None:
    matcher = llguidance.LLMatcher(info, grammar)
    matcher.compute_bitmask()
    if matcher.is_error():
        raise ValueError(matcher.get_error())


def random_allowed(row: torch.Tensor, vocab_size: int, rng: np.random.Generator) -> int:
    bits = ((row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab_size]
    return int(rng.choice(torch.nonzero(bits).flatten().numpy()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(2)
    for tok_name, tokenizer in tokenizers().items():
        for engine, bench in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
            figures = bench(tokenizer, args.steps, np.random.default_rng(0))
            print(f"{tok_name} | {engine} | " + ", ".join(f"{k}: {v:.3g}" for k, v in figures.items()), flush=True)


if __name__ == "__main__":
    main()
