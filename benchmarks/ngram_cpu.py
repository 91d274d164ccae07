"""N-gram speculation on real weights, on the CPU: SmolLM2-135M-Instruct (the bundled GGUF),
greedy, on chat prompts whose answers repeat text the prompt quotes (editing code, fixing a
paragraph, reformatting a list), where prompt lookup finds its drafts.

One process holds three engines, speculation off, on, and on under async scheduling (where the
proposer drafts from history one step stale: the acceptance it costs), and runs the same batch
through them in alternating rounds; each round prints their speeds (output tok/s over the
generate call), the acceptance each speculating engine's scheduler counted, whether the answers
equal speculation off's, and the load average (on a shared machine the per-round ratio is what
counts). Usage:

    PYTHONPATH=. python benchmarks/ngram_cpu.py --rounds 3 [--batch 1] [--k 4]
"""

from __future__ import annotations

import argparse
import time

from pagoda import LLM, SamplingParams
from pagoda.benchmarks.speculative import acceptance_probe

CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    tax = subtotal * tax_rate
    return subtotal + tax
"""

PARAGRAPH = (
    "The comittee met on tuesday to dicsuss the new budjet. After a long debate, the members "
    "agreed to increse funding for the library and to reduce spending on office supplys. The "
    "chair thanked everyone for there patience and closed the meeting at five o'clock."
)

ITEMS = "apples, bananas, carrots, dates, eggs, flour, grapes, honey, ice cream, jam, kale, lemons"

TASKS = [
    f"Rename the variable `subtotal` to `net` in this Python function and show the whole function:\n\n{CODE}",
    f"Add a docstring to this Python function and show the whole function:\n\n{CODE}",
    f"Fix the spelling mistakes in this paragraph and write it out again in full:\n\n{PARAGRAPH}",
    f"Rewrite this shopping list as a numbered list, one item per line: {ITEMS}",
    f'Repeat this sentence word for word, inside quotes: "{PARAGRAPH}"',
    f"Convert this Python function to use a list comprehension and show the result:\n\n{CODE}",
    f"Write this list in alphabetical order, separated by commas: {ITEMS}",
    f"Quote the first two sentences of this paragraph exactly, then summarize it:\n\n{PARAGRAPH}",
]


def load_average() -> str:
    with open("/proc/loadavg") as file:
        return " ".join(file.read().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=len(TASKS), help=f"prompts per generate call (1..{len(TASKS)})")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    if not 1 <= args.batch <= len(TASKS):
        parser.error(f"--batch must be in [1, {len(TASKS)}], got {args.batch}")

    engine = {"device": "cpu", "dtype": args.dtype}
    speculative_config = {"method": "ngram", "num_speculative_tokens": args.k}
    plain = LLM(**engine)
    speculating = {
        scheduling: LLM(**engine, speculative_config=speculative_config, async_scheduling=scheduling == "async")
        for scheduling in ("sync", "async")
    }
    conversations = [[{"role": "user", "content": task}] for task in TASKS[: args.batch]]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for llm in (plain, *speculating.values()):
        llm.chat(conversations[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)

    def timed(llm: LLM) -> tuple[list[list[int]], float]:
        start = time.perf_counter()
        outputs = llm.chat(conversations, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = [list(output.outputs[0].token_ids) for output in outputs]
        return tokens, sum(map(len, tokens)) / seconds

    print(f"SmolLM2-135M-Instruct, {args.dtype}, {len(conversations)} prompts, greedy, n-gram k = {args.k}")
    for round_index in range(args.rounds):
        off_tokens, off_rate = timed(plain)
        print(f"round {round_index}: off {off_rate:.1f} tok/s (load {load_average()})", flush=True)
        for scheduling, llm in speculating.items():
            probe = acceptance_probe(llm)
            assert probe is not None
            (on_tokens, on_rate), acceptance = probe(lambda llm=llm: timed(llm))
            same = sum(a == b for a, b in zip(off_tokens, on_tokens, strict=True))
            print(
                f"  on, {scheduling}: {on_rate:.1f} tok/s ({on_rate / off_rate:.2f}x); {acceptance.summary()}; "
                f"answers identical {same}/{len(conversations)} (load {load_average()})",
                flush=True,
            )
    for llm in (plain, *speculating.values()):
        llm.shutdown()


if __name__ == "__main__":
    main()
