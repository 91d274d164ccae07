"""CLIP's vision transformer (the vision tower of LLaVA), run up to the layer whose hidden states
a model reads. Images are few per step and of one size, so it runs eagerly in plain PyTorch,
replicated on every tensor-parallel rank; bidirectional attention through SDPA."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size))
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, config.patch_size, config.patch_size, bias=False
        )
        self.patch_size = config.patch_size
        self.image_size = config.image_size
        self.num_positions = (config.image_size // config.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(self.num_positions, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] at the configured size -> [N, 1 + patches, hidden] (CLS first). The
        patch convolution (kernel = stride) runs as the matmul it is over the image cut into
        patches: float32 stays exact on CUDA, where cuDNN convolutions run in TF32 by default."""
        n, channels, height, width = pixel_values.shape
        if (height, width) != (self.image_size, self.image_size):
            raise ValueError(
                f"images of {height}x{width} pixels; this vision tower takes {self.image_size}x{self.image_size}"
            )
        weight = self.patch_embedding.weight
        side, p = height // self.patch_size, self.patch_size
        cut = pixel_values.to(weight.dtype).view(n, channels, side, p, side, p).permute(0, 2, 4, 1, 3, 5)
        patches = F.linear(cut.reshape(n, side * side, channels * p * p), weight.view(len(weight), -1))
        cls = self.class_embedding.expand(n, 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, length, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(n, length, hidden))


class CLIPMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACT2FN[config.hidden_act]
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = CLIPAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = CLIPMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, config: PretrainedConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config) for _ in range(num_layers))


class CLIPVisionTower(nn.Module):
    """Hidden states of the layers `feature_layers` (HF's hidden_states indices: 0 is the input
    to the first layer, -1 the last layer's output), concatenated on the hidden dimension. Only
    the layers up to the deepest one read are built (the checkpoint's others are skipped)."""

    def __init__(self, config: PretrainedConfig, feature_layers: list[int]) -> None:
        super().__init__()
        total = config.num_hidden_layers
        self.feature_layers = [layer if layer >= 0 else total + 1 + layer for layer in feature_layers]
        if not all(0 <= layer <= total for layer in self.feature_layers):
            raise ValueError(f"vision_feature_layer {feature_layers} is outside the tower's {total} layers")
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = CLIPEncoder(config, max(self.feature_layers))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden = self.pre_layrnorm(self.embeddings(pixel_values))
        selected = {0: hidden} if 0 in self.feature_layers else {}
        for index, layer in enumerate(self.encoder.layers, start=1):
            hidden = layer(hidden)
            if index in self.feature_layers:
                selected[index] = hidden
        return torch.cat([selected[layer] for layer in self.feature_layers], dim=-1)
