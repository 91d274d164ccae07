"""LLaVA-1.5 (`LlavaForConditionalGeneration`): a CLIP vision tower and a two-layer MLP projector
in front of a Llama-family decoder. Each image is resized to the tower's fixed size, so it
becomes a fixed number of placeholder tokens whose embeddings are the projected patch features.

The decoder is the text config's own class (Llama, Mistral, Qwen2...), built under "model" as for
a text-only model; the checkpoint's names are mapped onto it from both the transformers 5 layout
(`model.language_model.*`, `model.vision_tower.*`) and the published one (`language_model.model.*`,
`vision_tower.vision_model.*`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from pagoda.attention.backends import AttentionBackend
from pagoda.forward_context import ForwardContext
from pagoda.model.layers.weight_utils import default_weight_loader
from pagoda.model.models.clip import CLIPVisionTower
from pagoda.model.models.decoder import DecoderForCausalLM, DecoderOptions
from pagoda.model.registry import get_model_class
from pagoda.outputs import IntermediateTensors

# (checkpoint prefix, ours), the first that matches wins.
_NAME_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, config: PretrainedConfig, num_feature_layers: int) -> None:
        super().__init__()
        text_hidden = config.text_config.hidden_size
        bias = config.multimodal_projector_bias
        self.linear_1 = nn.Linear(config.vision_config.hidden_size * num_feature_layers, text_hidden, bias=bias)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(DecoderForCausalLM):
    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        if config.vision_config.model_type != "clip_vision_model":
            raise ValueError(
                f"LLaVA with a {config.vision_config.model_type!r} vision tower is not supported; only CLIP"
            )
        if config.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(
                f"vision_feature_select_strategy {config.vision_feature_select_strategy!r} is not supported"
            )
        super().__init__(config.get_text_config(), attn_backend)
        self.vlm_config = config
        layers = config.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else list(layers)
        self.vision_tower = CLIPVisionTower(config.vision_config, layers)
        self.multi_modal_projector = LlavaMultiModalProjector(config, len(layers))
        self.drop_cls = config.vision_feature_select_strategy == "default"
        vision = config.vision_config
        self.max_tokens_per_image = (vision.image_size // vision.patch_size) ** 2 + (0 if self.drop_cls else 1)

    @classmethod
    def build_model(cls, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> nn.Module:
        return get_model_class(config).build_model(config, attn_backend)

    @classmethod
    def decoder_options(cls, config: PretrainedConfig) -> DecoderOptions:
        return get_model_class(config).decoder_options(config)

    @property
    def encoder_graph_input_shape(self) -> tuple[int, ...]:
        """Every image's `pixel_values` shape: the encoder (`encode_images`) can run as CUDA graphs."""
        vision = self.vlm_config.vision_config
        return (vision.num_channels, vision.image_size, vision.image_size)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] processed images -> [N, tokens per image, text hidden] placeholder embeddings."""
        features = self.vision_tower(pixel_values)
        if self.drop_cls:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def embed_multimodal(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Processed images (`pixel_values` [3, H, W] each, all one size) -> each one's placeholder
        embeddings [tokens per image, text hidden], encoded in one batch."""
        return list(self.encode_images(torch.stack([item["pixel_values"] for item in items])))

    def dummy_mm_items(self, num_tokens: int) -> list[dict[str, torch.Tensor]]:
        """As many images as `num_tokens` encoder output tokens hold (at least one), for profiling."""
        num_images = max(1, num_tokens // self.max_tokens_per_image)
        weight = self.multi_modal_projector.linear_1.weight
        pixels = torch.zeros(self.encoder_graph_input_shape, dtype=weight.dtype, device=weight.device)
        return [{"pixel_values": pixels}] * num_images

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        context: ForwardContext,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        inputs_embeds = None
        mm = context.mm_embeddings
        if mm is not None and self.model.is_first_stage:
            inputs_embeds = self.model.embed_tokens(input_ids)
            inputs_embeds = inputs_embeds.index_copy(0, mm.token_index, mm.embeddings.to(inputs_embeds.dtype))
        return self.model(input_ids, positions, context, intermediate_tensors, inputs_embeds=inputs_embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The decoder's weights through the decoder's loader, the tower's and projector's here;
        the tower's layers past the deepest one read (and its unused post-norm) are skipped."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def decoder_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for hf_name, tensor in weights:
                name = _our_name(hf_name)
                if not name.startswith(_VISION_PREFIXES):
                    yield name, tensor
                elif name in params:
                    default_weight_loader(params[name], tensor)
                    loaded.add(name)
                elif not name.startswith("vision_tower."):
                    raise ValueError(f"checkpoint weight {hf_name!r} has no parameter in {type(self).__name__}")

        return super().load_weights(decoder_weights()) | loaded


def _our_name(hf_name: str) -> str:
    for prefix, ours in _NAME_PREFIXES:
        if hf_name.startswith(prefix):
            return ours + hf_name[len(prefix) :]
    return hf_name
