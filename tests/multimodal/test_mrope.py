"""M-RoPE positions against HF Qwen2.5-VL's get_rope_index, and the prompt processing against
HF's LlavaProcessor (the same token ids and pixels)."""

from __future__ import annotations

import torch
from transformers import AutoImageProcessor, AutoTokenizer, LlavaProcessor
from vlm_utils import PATCH_SIZE, random_image

from pagoda.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from pagoda.multimodal.mrope import mrope_layout


def test_positions_match_hf_get_rope_index(tiny_qwen2_5_vl) -> None:
    _, hf_model = tiny_qwen2_5_vl
    config = hf_model.config
    grids = [(1, 4, 6), (1, 8, 4), (1, 2, 2)]
    features, token_ids, offset = [], [5, 6, 7], 3
    for i, grid in enumerate(grids):
        length = grid[1] * grid[2] // 4
        data = {"image_grid_thw": torch.tensor(grid)}
        features.append(MultiModalFeatureSpec(data, "image", str(i), PlaceholderRange(offset + 1, length)))
        token_ids += [config.vision_start_token_id, *[config.image_token_id] * length, config.vision_end_token_id, 9]
        offset = len(token_ids)
    ids = torch.tensor([token_ids])
    expected, delta = hf_model.model.get_rope_index(
        ids, (ids == config.image_token_id).int(), image_grid_thw=torch.tensor(grids)
    )
    layout = mrope_layout(features, 2)
    index = torch.arange(len(token_ids)).numpy()
    text = layout.text_positions(index)
    ours = torch.from_numpy(text)[None].repeat(3, 1)
    for i, f in enumerate(features):
        position = f.mm_position
        ours[:, position.offset : position.end] = torch.from_numpy(layout.image_positions(i, 0, position.length))
    assert torch.equal(ours, expected[:, 0])
    assert int(layout.shifts[-1]) == int(delta)  # decode positions: index + the prompt's delta


def test_llava_prompt_processing_matches_hf_processor(tiny_llava) -> None:
    from pagoda.multimodal.image import MediaLimits
    from pagoda.multimodal.processing import MultiModalProcessor

    path, hf_model = tiny_llava
    tokenizer = AutoTokenizer.from_pretrained(path)
    processor = LlavaProcessor(
        image_processor=AutoImageProcessor.from_pretrained(path),
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # the CLS token (dropped by "default"), as published processors say
    )
    images = [random_image(50, 40, 0), random_image(20, 70, 1)]
    text = "user : w1 <image> w2 <image> w3"
    reference = processor(text=text, images=images, return_tensors="pt")

    class Config:
        model = path
        hf_config = hf_model.config

    ours = MultiModalProcessor(Config(), MediaLimits())

    def encode(piece: str, special: bool) -> list[int]:
        return tokenizer.encode(piece, add_special_tokens=special, split_special_tokens=True)

    _, token_ids, features = ours.process_prompt(
        {"prompt": text, "multi_modal_data": {"image": images}}, encode, "<image>"
    )
    assert token_ids == reference["input_ids"][0].tolist()
    assert torch.equal(torch.stack([f.data["pixel_values"] for f in features]), reference["pixel_values"])
