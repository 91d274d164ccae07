"""What the speculative-decoding end-to-end tests share: prompts, the sampling settings every
proposer is run under, and runs with speculation on and off (the off run cached per engine)."""

from __future__ import annotations

import random

import numpy as np

from pagoda import LLM, SamplingParams
from pagoda.outputs import RequestOutput

NEW_TOKENS = 14


def prompts(seed: int, count: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(rng.randint(3, 30))] for _ in range(count)]


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=11, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=5, n=3, max_tokens=NEW_TOKENS, ignore_eos=True),
    # Settings applied per position: penalties, bias, bad words, min_tokens' hidden stop tokens.
    SamplingParams(
        temperature=0.0,
        max_tokens=NEW_TOKENS,
        repetition_penalty=1.2,
        frequency_penalty=0.3,
        logit_bias={36: 2.0},
        bad_words_token_ids=[[36, 36, 36]],
        min_tokens=6,
        stop_token_ids=[61],
        logprobs=1,
    ),
]


def outcome(outputs: list[RequestOutput]) -> list:
    return [
        [
            (
                c.token_ids,
                c.finish_reason,
                c.stop_reason,
                None if c.logprobs is None else [sorted(d) for d in c.logprobs],
            )
            for c in output.outputs
        ]
        for output in outputs
    ]


def logprob_values(outputs: list[RequestOutput]) -> np.ndarray:
    return np.array(
        [lp.logprob for o in outputs for c in o.outputs for d in c.logprobs or [] for lp in d.values()],
        dtype=np.float64,
    )


def run(path: str, engine: dict, speculative: dict | None, prompt_seed: int = 0) -> tuple[list, np.ndarray, LLM]:
    """Every prompt under every setting of PARAMS, in one batch."""
    llm = LLM(model=path, **engine, speculative_config=speculative)
    batch = prompts(prompt_seed)
    outputs = llm.generate(batch * len(PARAMS), [p for p in PARAMS for _ in batch], use_tqdm=False)
    llm.llm_engine.check_idle()
    return outcome(outputs), logprob_values(outputs), llm


_references: dict = {}


def reference(path: str, engine: dict, prompt_seed: int = 0) -> tuple[list, np.ndarray]:
    key = (path, tuple(sorted(engine.items())), prompt_seed)
    if key not in _references:
        results, values, llm = run(path, engine, None, prompt_seed)
        llm.shutdown()
        _references[key] = results, values
    return _references[key]
