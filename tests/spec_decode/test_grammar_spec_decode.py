"""Speculative decoding under grammars: n-gram drafts of constrained requests are verified with a
mask per position (each after the drafts before it), drafts the grammar refuses are rejected,
and the grammar rolls back to what was accepted: outputs are those of running without
speculation, greedy and seeded, sync and async, on the CPU in float32.

The tiny qwen3 checkpoint loops, so drafts from its own output are accepted; prompts that
repeat each letter-digit pair followed by "x" make the lookup draft "x" after every pair (the
prompt's occurrence comes first), which the grammar refuses; a JSON prompt drafts a string
where the schema wants a boolean.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from model_utils import save_tiny_checkpoint
from structured_output.byte_tokenizer import save_byte_tokenizer

from pagoda import LLM, SamplingParams, StructuredOutputsParams
from pagoda.structured_output.state import GrammarState

PAIRS = r"([a-e][0-4])+"
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}
REFUSED_PROMPT = list("".join(f"{c}{d}x" for c in "abcde" for d in "01234").encode())
JSON_PROMPT = list(b'{"n": 7, "ok": "maybe"} {"n": 7, "ok": "maybe"}')
NEUTRAL_PROMPT = [200 + i % 50 for i in range(24)]


@pytest.fixture(scope="module")
def qwen3_bytes(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("qwen3-bytes"))
    save_tiny_checkpoint("qwen3", path)
    save_byte_tokenizer(path)
    return path


def requests() -> tuple[list[list[int]], list[SamplingParams]]:
    pairs = StructuredOutputsParams(regex=PAIRS)
    schema = StructuredOutputsParams(json=SCHEMA)
    cases = [(NEUTRAL_PROMPT, pairs), (REFUSED_PROMPT, pairs), (JSON_PROMPT, schema), (NEUTRAL_PROMPT, schema)]
    prompts, params = [], []
    for prompt, structured in cases:
        for i, temperature in enumerate((0.0, 0.8)):
            prompts.append(prompt)
            params.append(SamplingParams(temperature=temperature, seed=i, max_tokens=16, structured_outputs=structured))
    return prompts, params


def run(path: str, async_scheduling: bool, speculative: dict | None) -> tuple[list, LLM]:
    llm = LLM(
        model=path,
        device="cpu",
        dtype="float32",
        max_model_len=128,
        num_gpu_blocks=128,
        async_scheduling=async_scheduling,
        speculative_config=speculative,
    )
    prompts, params = requests()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.check_idle()
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs], llm


@pytest.fixture(scope="module")
def expected(qwen3_bytes: str) -> list:
    results, llm = run(qwen3_bytes, async_scheduling=False, speculative=None)
    llm.shutdown()
    return results


@pytest.mark.parametrize(
    "async_scheduling", [pytest.param(False, id="sync", marks=pytest.mark.slow), pytest.param(True, id="async")]
)
def test_constrained_outputs_are_identical_with_speculation(
    qwen3_bytes: str, expected: list, async_scheduling: bool, monkeypatch
) -> None:
    refused = []
    accept = GrammarState.accept

    def counting(self, token_ids, tentative=False):
        result = accept(self, token_ids, tentative)
        if tentative and not result:
            refused.append(token_ids)
        return result

    monkeypatch.setattr(GrammarState, "accept", counting)
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    results, llm = run(qwen3_bytes, async_scheduling, speculative)
    stats = llm.llm_engine.engine_core.scheduler.make_stats().spec_decoding
    llm.shutdown()
    assert results == expected
    for (token_ids, finish_reason), params in zip(results, requests()[1], strict=True):
        text = bytes(t for t in token_ids if t != 0).decode()
        if params.structured_outputs.regex is not None:
            assert re.fullmatch(PAIRS, text) or re.fullmatch(PAIRS, text + "0"), text  # may stop after a letter
        elif finish_reason == "stop":
            jsonschema.validate(json.loads(text), SCHEMA)
    assert stats.num_accepted_tokens > 0  # drafts of constrained requests were verified and kept
    assert refused  # and drafts the grammar refused were rejected
