"""Front-end processing of a multimodal prompt: images decoded and preprocessed by the model's HF
image processor, each image's placeholder token expanded into the run of tokens its encoder
output fills, and each processed image hashed. Runs where the processor runs (the front end, off
the server's event loop); the core receives tensors and hashes, never files."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from transformers import PretrainedConfig

from pagoda.config import ModelConfig
from pagoda.errors import InvalidRequestError
from pagoda.multimodal.hashing import hash_item
from pagoda.multimodal.image import MediaLimits, load_image
from pagoda.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

IMAGE = "image"


class ImagePlaceholders(Protocol):
    """What a model family says about its images in a prompt."""

    # The token one image is written as (and its placeholder run is made of).
    image_token_id: int
    # The tokens an image part of a chat becomes (the image token with the family's delimiters).
    prompt_token_ids: list[int]

    def items(self, processed: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """The image processor's batch output, one dict of encoder inputs per image."""
        ...

    def num_image_tokens(self, item: dict[str, torch.Tensor]) -> int:
        """Placeholder tokens (= encoder output rows) of one processed image."""
        ...


class LlavaPlaceholders:
    """LLaVA-1.5: `<image>`, one token per vision patch (the CLS token too with the "full" strategy)."""

    def __init__(self, config: PretrainedConfig) -> None:
        self.image_token_id = int(config.image_token_id)
        self.prompt_token_ids = [self.image_token_id]
        self.patch_size = int(config.vision_config.patch_size)
        self.extra = 1 if config.vision_feature_select_strategy == "full" else 0

    def items(self, processed: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        return [{"pixel_values": pixels.clone()} for pixels in processed["pixel_values"]]

    def num_image_tokens(self, item: dict[str, torch.Tensor]) -> int:
        height, width = item["pixel_values"].shape[-2:]
        return (height // self.patch_size) * (width // self.patch_size) + self.extra


class Qwen2VLPlaceholders:
    """Qwen2-VL / Qwen2.5-VL: `<|vision_start|><|image_pad|><|vision_end|>`, one pad token per
    2x2 block of patches of the image at its own resolution (`image_grid_thw`: patches in time,
    height, width)."""

    def __init__(self, config: PretrainedConfig) -> None:
        self.image_token_id = int(config.image_token_id)
        self.prompt_token_ids = [
            int(config.vision_start_token_id),
            self.image_token_id,
            int(config.vision_end_token_id),
        ]
        self.merge = int(config.vision_config.spatial_merge_size)

    def items(self, processed: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        grids = processed["image_grid_thw"]
        patches = processed["pixel_values"].split(grids.prod(-1).tolist())
        return [{"pixel_values": p.clone(), "image_grid_thw": g.clone()} for p, g in zip(patches, grids, strict=True)]

    def num_image_tokens(self, item: dict[str, torch.Tensor]) -> int:
        return int(item["image_grid_thw"].prod()) // self.merge**2


_PLACEHOLDERS: dict[str, Callable[[PretrainedConfig], ImagePlaceholders]] = {
    "llava": LlavaPlaceholders,
    "qwen2_5_vl": Qwen2VLPlaceholders,
}


def is_multimodal(hf_config: PretrainedConfig) -> bool:
    return getattr(hf_config, "model_type", None) in _PLACEHOLDERS


class MultiModalProcessor:
    """Prompt (text or token ids) + images -> token ids with placeholders, and one feature per image."""

    def __init__(self, model_config: ModelConfig, limits: MediaLimits) -> None:
        self.model_path = model_config.model
        self.placeholders = _PLACEHOLDERS[model_config.hf_config.model_type](model_config.hf_config)
        self.limits = limits

    @functools.cached_property
    def image_processor(self) -> Any:
        """The checkpoint's saved image processor (its preprocessor_config.json)."""
        from transformers import AutoImageProcessor

        try:
            return AutoImageProcessor.from_pretrained(self.model_path)
        except (OSError, ValueError) as error:
            raise InvalidRequestError(
                "multi_modal_data", f"this model has no image processor config to prepare images with: {error}"
            ) from error

    def images_of(self, mm_data: Any) -> list[Any]:
        """The request's images, decoded (RGB PIL images), in prompt order."""
        if not isinstance(mm_data, dict) or set(mm_data) - {IMAGE}:
            raise InvalidRequestError("multi_modal_data", "multi_modal_data must be a dict with the key 'image' only")
        items = mm_data.get(IMAGE, [])
        items = list(items) if isinstance(items, (list, tuple)) else [items]
        if len(items) > self.limits.max_images:
            raise InvalidRequestError(
                "multi_modal_data.image",
                f"multi_modal_data.image has {len(items)} images; at most {self.limits.max_images} per request",
            )
        return [load_image(item, f"multi_modal_data.image[{i}]", self.limits) for i, item in enumerate(items)]

    def process(self, token_ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        """Expand each image token of `token_ids` (one per image, in order) into its placeholder run."""
        image_token_id = self.placeholders.image_token_id
        positions = [i for i, token in enumerate(token_ids) if token == image_token_id]
        if len(positions) != len(images):
            raise InvalidRequestError(
                "multi_modal_data.image",
                f"the prompt has {len(positions)} image placeholders and multi_modal_data.image {len(images)} "
                "images; each image needs one placeholder where it goes",
            )
        if not images:
            return list(token_ids), []
        try:
            items = self.placeholders.items(self.image_processor(list(images), return_tensors="pt"))
        except InvalidRequestError:
            raise
        except Exception as error:  # an image the processor cannot prepare is the request's fault
            raise InvalidRequestError(
                "multi_modal_data.image", f"the images could not be processed: {error}"
            ) from error
        expanded: list[int] = []
        features = []
        previous = 0
        for position, item in zip(positions, items, strict=True):
            length = self.placeholders.num_image_tokens(item)
            expanded += token_ids[previous:position]
            features.append(
                MultiModalFeatureSpec(
                    data=item,
                    modality=IMAGE,
                    identifier=hash_item(IMAGE, item),
                    mm_position=PlaceholderRange(len(expanded), length),
                )
            )
            expanded += [image_token_id] * length
            previous = position + 1
        expanded += token_ids[previous:]
        return expanded, features

    def process_prompt(
        self, prompt: dict[str, Any], encode: Callable[[str, bool], list[int]], image_text: str | None
    ) -> tuple[str | None, list[int], list[MultiModalFeatureSpec]]:
        """A vLLM-style prompt dict: `prompt` (text, each image written as `image_text`: the model's
        image tokens as text, delimiters included) or `prompt_token_ids` (each image one image
        token id), with `multi_modal_data`."""
        images = self.images_of(prompt.get("multi_modal_data") or {})
        text = prompt.get("prompt")
        if isinstance(text, str):
            if image_text is None:
                raise InvalidRequestError("prompt", "this model has no tokenizer: send prompt_token_ids")
            pieces = text.split(image_text)
            token_ids = encode(pieces[0], True)
            for piece in pieces[1:]:
                token_ids += [*self.placeholders.prompt_token_ids, *encode(piece, False)]
        else:
            text = None
            token_ids = prompt.get("prompt_token_ids")
            if not isinstance(token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in token_ids
            ):
                raise InvalidRequestError(
                    "prompt", "a prompt dict needs 'prompt' (a string) or 'prompt_token_ids' (ints)"
                )
        token_ids, features = self.process(token_ids, images)
        return text, token_ids, features
