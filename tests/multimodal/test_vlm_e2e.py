"""LLaVA-1.5 and Qwen2.5-VL end to end against HF transformers: greedy tokens up to the first
step whose top-2 margin is under 1e-3 and first-step logits within 1e-4 (float32), for prompts
with 0, 1 and 3 images of different sizes batched with text-only ones, under chunked prefill that
splits an image's placeholders and under preemption; the encoder cache and the prefix cache with
images; bad images refused while the engine goes on."""

from __future__ import annotations

import pytest
import torch
from engine_utils import TARGETS, target_settings
from model_utils import assert_greedy_match
from transformers import AutoImageProcessor
from vlm_utils import QWEN_IMAGE_TEXT, TOKENS_PER_IMAGE, hf_vlm_greedy, random_image

from pagoda.entrypoints.llm import LLM
from pagoda.errors import InvalidRequestError
from pagoda.sampling_params import SamplingParams

MIN_MARGIN = 1e-3
LOGITS_ATOL = 1e-4
MAX_TOKENS = 6
TOP = 5


# How each model writes an image in a text prompt.
IMAGE_TEXT = {"llava": "<image>", "qwen2_5_vl": QWEN_IMAGE_TEXT}


@pytest.fixture(params=["llava", "qwen2_5_vl"])
def tiny_vlm(request):
    """(model family, checkpoint directory, HF model)."""
    return request.param, *request.getfixturevalue(f"tiny_{request.param}")


def prompts_with_images(family: str) -> list[dict | str]:
    """Text-only prompts among prompts of one and three images of different sizes (LLaVA's
    processor resizes each to the tower's 30x30; Qwen's keeps each one's own resolution)."""
    image = IMAGE_TEXT[family]
    return [
        "user : w1 w2 w3 w4 w5",
        {"prompt": f"user : w7 {image} w8 w9", "multi_modal_data": {"image": random_image(40, 52, 1)}},
        {
            "prompt": f"user : w10 {image} w11 {image} w12 w13 {image} w14",
            "multi_modal_data": {
                "image": [random_image(64, 20, 2), random_image(30, 30, 3), random_image(200, 150, 4)]
            },
        },
        {"prompt": "user : w20 w21 w22", "multi_modal_data": {}},
        {"prompt": f"user : w30 {image} w31", "multi_modal_data": {"image": [random_image(33, 33, 5)]}},
    ]


def hf_reference(model, path: str, prompt_ids: list[int], prompt) -> tuple[list[int], list[float], torch.Tensor]:
    images = prompt.get("multi_modal_data", {}).get("image", []) if isinstance(prompt, dict) else []
    images = images if isinstance(images, list) else [images]
    mm_inputs = {}
    if images:
        mm_inputs = dict(AutoImageProcessor.from_pretrained(path)(images, return_tensors="pt"))
        if "image_grid_thw" in mm_inputs:  # Qwen: which tokens are images, for its M-RoPE positions
            mm_inputs["mm_token_type_ids"] = (torch.tensor([prompt_ids]) == model.config.image_token_id).int()
    return hf_vlm_greedy(model, prompt_ids, mm_inputs, MAX_TOKENS)


def check_against_hf(llm: LLM, tiny_vlm, prompts) -> None:
    _, path, hf_model = tiny_vlm
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens, margins, first_logits = hf_reference(hf_model, path, output.prompt_token_ids, prompt)
        assert_greedy_match(list(output.outputs[0].token_ids), tokens, margins, MIN_MARGIN)
        ours = output.outputs[0].logprobs[0]
        reference = first_logits.topk(TOP)
        for token_id, value in zip(reference.indices.tolist(), reference.values.tolist(), strict=True):
            assert abs(ours[token_id].logprob - value) < LOGITS_ATOL, (token_id, ours[token_id].logprob, value)


@pytest.mark.parametrize("target", TARGETS)
def test_batch_matches_hf_with_chunks_splitting_images(tiny_vlm, target) -> None:
    """A step budget of 24 tokens: image runs of 25 tokens (LLaVA) and 6 to 60 (Qwen) are split
    across chunks and steps; an encoder budget of 64 tokens holds two images a step."""
    llm = LLM(
        tiny_vlm[1],
        max_model_len=512,
        max_num_batched_tokens=24,
        max_num_encoder_input_tokens=64,
        logprobs_mode="raw_logits",
        **target_settings(target),
    )
    prompts = prompts_with_images(tiny_vlm[0])
    check_against_hf(llm, tiny_vlm, prompts)
    if tiny_vlm[0] == "llava":
        image_prompt_len = len(llm.llm_engine.processor.process("x", prompts[2], SamplingParams())[0].prompt_token_ids)
        assert image_prompt_len == 8 + 3 * TOKENS_PER_IMAGE  # <s> user : and five words


def test_matches_hf_under_preemption(tiny_vlm) -> None:
    """A pool of 24 blocks of 4 tokens for prompts of up to 90 tokens: requests preempt each
    other and resume (their images encoded again, from the encoder cache)."""
    llm = LLM(
        tiny_vlm[1],
        max_model_len=512,
        max_num_batched_tokens=32,
        max_num_encoder_input_tokens=64,
        block_size=4,
        num_gpu_blocks=24,
        logprobs_mode="raw_logits",
        **target_settings(("cpu", "torch", False)),
    )
    check_against_hf(llm, tiny_vlm, prompts_with_images(tiny_vlm[0])[1:3] * 2)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


def runner_of(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner


def test_encoder_cache_hit_and_prefix_cache_with_images(tiny_llava) -> None:
    llm = LLM(tiny_llava[0], max_model_len=256, block_size=4, **target_settings(("cpu", "torch", False)))
    encoder = runner_of(llm).encoder_runner
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    params = SamplingParams(temperature=0.0, max_tokens=2)
    image, other = random_image(40, 40, 7), random_image(40, 40, 8)

    def run(text: str, picture) -> list[int]:
        return list(
            llm.generate({"prompt": text, "multi_modal_data": {"image": picture}}, params)[0].outputs[0].token_ids
        )

    first = run("user : w1 w2 w3 <image> w4", image)
    assert (encoder.cache.hits, encoder.num_encoded_images) == (0, 1)
    # Another text before the same image: no prefix hit on its blocks, an encoder cache hit.
    run("user : w9 w8 w7 <image> w4", image)
    assert (encoder.cache.hits, encoder.num_encoded_images) == (1, 1)
    # The same prompt and image: every full block but the last token's hits the prefix cache.
    hits_before = kv.prefix_cache_hits
    assert run("user : w1 w2 w3 <image> w4", image) == first
    prompt_len = 7 + TOKENS_PER_IMAGE
    assert kv.prefix_cache_hits - hits_before == (prompt_len - 1) // 4 * 4
    # A different image after the same text: only the blocks before the image hit.
    hits_before = kv.prefix_cache_hits
    run("user : w1 w2 w3 <image> w4", other)
    assert kv.prefix_cache_hits - hits_before == 4  # the image starts at token 6, in the second block
    assert encoder.num_encoded_images == 2


def test_bad_images_are_refused_and_the_engine_goes_on(tiny_llava) -> None:
    llm = LLM(tiny_llava[0], max_model_len=256, **target_settings(("cpu", "torch", False)))
    params = SamplingParams(temperature=0.0, max_tokens=2)
    cases = [
        ({"image": b"\x89PNG\r\n\x1a\n broken"}, "not a readable image"),
        ({"image": b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n"}, "not a readable image"),
        ({"image": "data:image/png;base64,@@@notbase64"}, "base64"),
        ({"image": "https://example.com/cat.png"}, "not allowed"),
        ({"image": [random_image(8, 8, 0), random_image(8, 8, 1)]}, "placeholders"),
        ({"video": []}, "'image' only"),
    ]
    for mm_data, words in cases:
        with pytest.raises(InvalidRequestError, match=words) as error:
            llm.generate({"prompt": "user : <image> w1", "multi_modal_data": mm_data}, params)
        assert error.value.param.startswith("multi_modal_data")
    good = {"prompt": "user : <image> w1", "multi_modal_data": {"image": random_image(8, 8, 0)}}
    assert len(llm.generate(good, params)[0].outputs[0].token_ids) == 2


def test_abort_mid_image_frees_its_encoder_cache_entry(tiny_llava) -> None:
    """A request aborted while its image's placeholders are half computed: the runner drops its
    images and cache holds (the entry stays, idle, for a later request with the image)."""
    llm = LLM(
        tiny_llava[0],
        max_model_len=256,
        max_num_batched_tokens=16,
        max_num_encoder_input_tokens=32,
        **target_settings(("cpu", "torch", False)),
    )
    engine = llm.llm_engine
    prompt = {"prompt": "user : w1 <image> w2", "multi_modal_data": {"image": random_image(20, 20, 3)}}
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=4))
    engine.step()  # the first 16 of 30 prompt tokens: the image encoded, its placeholders half placed
    encoder = runner_of(llm).encoder_runner
    assert encoder.num_encoded_images == 1 and encoder.cache.held_req_ids == [request_id]
    engine.abort_requests([request_id])
    while engine.engine_core.has_work():
        engine.step()
    assert encoder.cache.held_req_ids == [] and encoder.cache.num_entries == 1
    engine.check_idle()


def test_chat_image_parts_become_the_models_image_tokens(tiny_vlm) -> None:
    """LLM.chat's content parts: an image part is written as the family's image tokens where it
    was (Qwen's with its vision start/end), the same prompt and answer as the text prompt."""
    family, path, _ = tiny_vlm
    llm = LLM(path, max_model_len=512, **target_settings(("cpu", "torch", False)))
    image = random_image(40, 40, 9)
    params = SamplingParams(temperature=0.0, max_tokens=3)
    content = [
        {"type": "text", "text": "w1"},
        {"type": "image_pil", "image_pil": image},
        {"type": "text", "text": "w2"},
    ]
    (chat,) = llm.chat([{"role": "user", "content": content}], params)
    text = f"<s>user : w1\n{IMAGE_TEXT[family]}\nw2 </s> assistant : "
    tokenizer = llm.get_tokenizer()
    pieces = text.removeprefix("<s>").split(IMAGE_TEXT[family])
    expected_prefix = [tokenizer.bos_token_id, *tokenizer.encode(pieces[0], add_special_tokens=False)]
    (plain,) = llm.generate({"prompt": text.removeprefix("<s>"), "multi_modal_data": {"image": image}}, params)
    assert chat.prompt_token_ids[: len(expected_prefix)] == expected_prefix
    assert chat.prompt_token_ids == plain.prompt_token_ids
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids


def test_profile_run_includes_a_step_of_encoder_work(tiny_vlm) -> None:
    """The memory profile's dummy step encodes images totalling the encoder budget (at most), then
    runs the decoder with their outputs alive (what a real first chunk holds)."""
    llm = LLM(
        tiny_vlm[1],
        max_model_len=512,
        max_num_batched_tokens=128,
        max_num_encoder_input_tokens=64,
        **target_settings(("cpu", "torch", False)),
    )
    runner = runner_of(llm)
    outputs = runner.encoder_runner.profile_outputs()
    assert 25 <= sum(len(output) for output in outputs) <= 64
    runner.profile_run()
    assert runner.encoder_runner.cache.num_entries == 0  # profiling caches nothing


def test_pipeline_parallelism_is_refused(tiny_llava) -> None:
    from pagoda.config import ConfigError

    with pytest.raises(ConfigError, match="pipeline_parallel_size must be 1"):
        LLM(tiny_llava[0], pipeline_parallel_size=2, device="cpu")
