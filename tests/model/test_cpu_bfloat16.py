"""bfloat16 on the CPU (what dtype "auto" picks on CPUs with AVX-512 BF16 or AMX) against HF
transformers in bfloat16: a tiny seeded Llama, greedy tokens equal up to the first step whose HF
top-2 logit margin is under MIN_MARGIN (these random logits have small margins: that is 1-5
steps a prompt), the chosen tokens' logprobs there and every prompt token's logprob within
LOGPROB_ATOL.

Both round every activation to bfloat16 (8 bits of mantissa, relative steps of 2^-8), but at
different points (our fused QKV and gate/up products, the paged attention's bfloat16
probabilities), so their logits differ by a few bfloat16 steps: measured up to 0.017 on these
logprobs, every token equal. The weights are scaled like a trained model's
(`save_unit_gain_checkpoint`; an untied LM head, so logits are O(1) and logprobs far from 0), so
that rounding stays that small through the layers.
"""

from __future__ import annotations

import pytest
import torch
from model_utils import check_sample_against_hf, hf_greedy, hf_logprobs, save_unit_gain_checkpoint
from transformers import AutoConfig, AutoModelForCausalLM

from pagoda import LLM, SamplingParams

MIN_MARGIN = 0.05
LOGPROB_ATOL = 0.05
VOCAB = 512
PROMPTS = [[(11 * i + 5 * j) % VOCAB for j in range(5 + 3 * i)] for i in range(4)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    config = AutoConfig.for_model(
        "llama",
        vocab_size=VOCAB,
        hidden_size=192,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    path = str(tmp_path_factory.mktemp("bf16_llama"))
    save_unit_gain_checkpoint(config, path, seed=7)
    return path


def test_bfloat16_greedy_and_logprobs_match_hf_bfloat16(checkpoint) -> None:
    hf_model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    llm = LLM(model=checkpoint, device="cpu", dtype="bfloat16", max_model_len=64, num_gpu_blocks=64, block_size=4)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    assert all(cache.dtype == torch.bfloat16 for cache in runner.kv_caches.values())
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)  # one batch: decode rows attend together
    compared = [
        check_sample_against_hf(
            hf_model, prompt, out.outputs[0], hf_greedy(hf_model, prompt, MAX_TOKENS), MIN_MARGIN, LOGPROB_ATOL
        )
        for prompt, out in zip(PROMPTS, outputs, strict=True)
    ]
    assert min(compared) >= 1, compared
    for prompt, out in zip(PROMPTS, outputs, strict=True):  # every prompt position, whatever its margin
        ours = [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]
        expected = hf_logprobs(hf_model, prompt[:1], prompt[1:])
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(expected), atol=LOGPROB_ATOL, rtol=0)
    llm.llm_engine.check_idle()
