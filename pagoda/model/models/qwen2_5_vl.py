"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): a vision transformer over each image at its
own resolution (patches of 14 px, two frames deep; 2-D rotary positions; window attention in
all blocks but a few full-attention ones; 2x2 patches merged into one token) in front of a Qwen2
decoder whose rotary positions are M-RoPE's (pagoda/multimodal/mrope.py): image tokens rotate
by their (time, height, width) place, each third of the frequencies by one of the three.

The vision transformer runs eagerly in plain PyTorch, replicated on every tensor-parallel rank;
attention runs per window (or per image) as one padded SDPA batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagoda.attention.backends import AttentionBackend
from pagoda.forward_context import ForwardContext
from pagoda.model.layers.weight_utils import default_weight_loader
from pagoda.model.models.decoder import DecoderForCausalLM, DecoderOptions
from pagoda.outputs import IntermediateTensors

_NAME_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


class VisionRMSNorm(nn.Module):
    """RMSNorm in float32, as Qwen2's (eps 1e-6 in the vision blocks and the merger)."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
    """Bidirectional attention within each segment [cu[i], cu[i+1]) of q, k, v [N, heads, D], the
    segments padded to the longest and run as one SDPA batch (keys past a segment's end masked)."""
    lengths = np.diff(np.asarray(cu_seqlens))
    longest = int(lengths.max())
    num_tokens, heads, dim = q.shape
    if (lengths == longest).all():  # segments of one length (one image, even windows): no padding, no mask

        def batched(x: torch.Tensor) -> torch.Tensor:
            return x.view(len(lengths), longest, heads, dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(batched(q), batched(k), batched(v))
        return out.transpose(1, 2).reshape(num_tokens, heads, dim)
    segment = torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths)).to(q.device)
    offset = torch.arange(num_tokens, device=q.device) - torch.from_numpy(np.repeat(cu_seqlens[:-1], lengths)).to(
        q.device
    )

    def padded(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(len(lengths), longest, heads, dim)
        out[segment, offset] = x
        return out.transpose(1, 2)

    valid = torch.arange(longest, device=q.device)[None, :] < torch.from_numpy(lengths).to(q.device)[:, None]
    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=valid[:, None, None, :])
    return out.transpose(1, 2)[segment, offset]


class VisionAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(len(x), 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = cos[:, None], sin[:, None]
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        return self.proj(segment_attention(q, k, v, cu_seqlens).reshape(len(x), -1))


class VisionMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"vision hidden_act {config.hidden_act!r} is not supported; only 'silu'")
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(config.hidden_size)
        self.norm2 = VisionRMSNorm(config.hidden_size)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.hidden = config.hidden_size * config.spatial_merge_size**2
        self.ln_q = VisionRMSNorm(config.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, config.out_hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class PatchEmbed(nn.Module):
    """HF's Conv3d whose kernel equals its stride, computed as the matmul it is: each row of
    `pixel_values` is one flattened (C, T, P, P) patch, the weight's own layout. A matmul also
    keeps float32 exact on CUDA, where cuDNN convolutions run in TF32 by default."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        shape = (config.in_channels, config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, shape[1:], shape[1:], bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixel_values.to(weight.dtype), weight.view(len(weight), -1))


class VisionLayout:
    """Where each patch of a batch of images goes: its 2-D rotary position, the window order
    (patches regrouped so each window's are contiguous, merge blocks kept whole) and the window
    and image boundaries in that order. Host-side index math over the images' grids."""

    def __init__(self, grids: list[tuple[int, int, int]], config: PretrainedConfig) -> None:
        merge = config.spatial_merge_size
        unit = merge * merge
        window = config.window_size // merge // config.patch_size
        positions, window_index, cu_windows, cu_images = [], [], [0], [0]
        base = 0
        for t, h, w in grids:
            hpos, wpos = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
            block = (h // merge, merge, w // merge, merge)
            hw = np.stack(
                [hpos.reshape(block).transpose(0, 2, 1, 3).ravel(), wpos.reshape(block).transpose(0, 2, 1, 3).ravel()],
                -1,
            )
            positions.append(np.tile(hw, (t, 1)))
            gh, gw = h // merge, w // merge
            pad_h, pad_w = window - gh % window, window - gw % window
            index = np.full((t, gh + pad_h, gw + pad_w), -1, dtype=np.int64)
            index[:, :gh, :gw] = np.arange(t * gh * gw).reshape(t, gh, gw)
            nh, nw = (gh + pad_h) // window, (gw + pad_w) // window
            index = index.reshape(t, nh, window, nw, window).transpose(0, 1, 3, 2, 4).reshape(t, nh * nw, -1)
            counts = (index >= 0).sum(-1).ravel()
            flat = index.ravel()
            window_index.append(flat[flat >= 0] + base)
            cu_windows.extend((np.cumsum(counts) * unit + cu_windows[-1]).tolist())
            base += t * gh * gw
            cu_images.append(cu_images[-1] + t * h * w)
        self.positions = np.concatenate(positions)
        self.window_index = np.concatenate(window_index)
        self.cu_windows = list(dict.fromkeys(cu_windows))  # empty (padding-only) windows dropped
        self.cu_images = cu_images
        self.unit = unit


class Qwen2_5_VisionTransformer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        head_dim = config.hidden_size // config.num_heads
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        spatial = head_dim // 2
        self.register_buffer(
            "inv_freq", 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial)), persistent=False
        )
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.full_attention_blocks = set(config.fullatt_block_indexes)
        self.merger = PatchMerger(config)

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Patches of the images [sum t*h*w, C * T * P * P] -> merged tokens [sum t*h*w / 4, out hidden], image by image."""
        layout = VisionLayout(grids, self.config)
        device = pixel_values.device
        window_index = torch.from_numpy(layout.window_index).to(device)

        def window_order(x: torch.Tensor) -> torch.Tensor:
            return x.view(-1, layout.unit, *x.shape[1:])[window_index].flatten(0, 1)

        hidden = window_order(self.patch_embed(pixel_values))
        freqs = torch.from_numpy(layout.positions).to(device)[..., None].float() * self.inv_freq
        angles = window_order(freqs.flatten(1))
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        # Window order keeps images contiguous, so image boundaries are the same in it.
        for index, block in enumerate(self.blocks):
            cu = layout.cu_images if index in self.full_attention_blocks else layout.cu_windows
            hidden = block(hidden, cu, cos, sin)
        merged = self.merger(hidden)
        return merged[torch.argsort(window_index)]


class Qwen2_5_VLForConditionalGeneration(DecoderForCausalLM):
    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        text_config = config.get_text_config()
        if not hasattr(text_config, "tie_word_embeddings"):
            text_config.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        super().__init__(text_config, attn_backend)
        self.vlm_config = config
        vision = config.vision_config
        self.visual = Qwen2_5_VisionTransformer(vision)
        self.mrope_spatial_merge_size = vision.spatial_merge_size
        section = list(text_config.rope_parameters["mrope_section"])
        half = self.model.rotary_emb.cos_cache.shape[-1]
        if sum(section) != half:
            raise ValueError(f"mrope_section {section} must add up to half the head size ({half})")
        # Which of (time, height, width) rotates each frequency.
        self.register_buffer(
            "mrope_axis", torch.repeat_interleave(torch.arange(3), torch.tensor(section)), persistent=False
        )

    @classmethod
    def decoder_options(cls, config: PretrainedConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True)

    def embed_multimodal(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Processed images (`pixel_values` patches and `image_grid_thw` each) -> each one's
        placeholder embeddings, encoded in one batch."""
        grids = [tuple(int(x) for x in item["image_grid_thw"].tolist()) for item in items]
        merged = self.visual(torch.cat([item["pixel_values"] for item in items]), grids)
        unit = self.mrope_spatial_merge_size**2
        return list(merged.split([t * h * w // unit for t, h, w in grids]))

    def dummy_mm_items(self, num_tokens: int) -> list[dict[str, torch.Tensor]]:
        """One square image of about `num_tokens` merged tokens, for profiling: the most one step
        encodes, and the worst case of its full-attention blocks (one image attends to all of it)."""
        vision = self.vlm_config.vision_config
        merge = vision.spatial_merge_size
        side = max(1, int(num_tokens**0.5)) * merge
        weight = self.visual.patch_embed.proj.weight
        patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        pixels = torch.zeros(side * side, patch, dtype=weight.dtype, device=weight.device)
        return [{"pixel_values": pixels, "image_grid_thw": torch.tensor([1, side, side])}]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        context: ForwardContext,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """`positions` are the M-RoPE text positions; image tokens rotate by their three (in `context`)."""
        cos, sin = self.model.rotary_emb(positions)
        inputs_embeds = None
        mm = context.mm_embeddings
        if mm is not None:
            if mm.positions is not None:
                frequencies = torch.arange(len(self.mrope_axis), device=cos.device)
                cos, sin = cos.clone(), sin.clone()
                for table, cache in ((cos, self.model.rotary_emb.cos_cache), (sin, self.model.rotary_emb.sin_cache)):
                    per_axis = cache[mm.positions]  # [3, M, half]
                    table[mm.token_index, 0] = per_axis[self.mrope_axis, :, frequencies].T
            if self.model.is_first_stage:
                inputs_embeds = self.model.embed_tokens(input_ids)
                inputs_embeds = inputs_embeds.index_copy(0, mm.token_index, mm.embeddings.to(inputs_embeds.dtype))
        return self.model(
            input_ids, positions, context, intermediate_tensors, inputs_embeds=inputs_embeds, cos_sin=(cos, sin)
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def decoder_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for hf_name, tensor in weights:
                name = next((ours + hf_name[len(p) :] for p, ours in _NAME_PREFIXES if hf_name.startswith(p)), hf_name)
                if not name.startswith("visual."):
                    yield name, tensor
                    continue
                if name not in params:
                    raise ValueError(f"checkpoint weight {hf_name!r} has no parameter in {type(self).__name__}")
                default_weight_loader(params[name], tensor)
                loaded.add(name)

        return super().load_weights(decoder_weights()) | loaded
