"""`MambaMixer2`: the Mamba-2 token mixer, over a flat batch of requests with paged state.

in_proj -> (gate z, xBC, dt); xBC through the causal depthwise conv (its last conv_kernel - 1
inputs are the conv state) and SiLU; split into x, B, C; the selective scan (SSM state [heads,
head_dim, state_size]) with dt = softplus(dt + dt_bias), A = -exp(A_log) and the D skip;
RMSNorm of y * SiLU(z) per group of channels; out_proj. Each request's conv and SSM states sit
in its one block of the layer's `MambaSpec` group (see `MambaMetadata`).

On CUDA the conv and the scan run as Triton kernels (a chunked scan for batches with prefill
chunks, a single-step update for decode batches); elsewhere the torch reference (`ops_ref`).
Weights are named as in HF's Mamba2Mixer / BambaMixer; tensor parallelism is not supported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagoda.config import ConfigError
from pagoda.distributed.parallel_state import get_parallel_state
from pagoda.forward_context import ForwardContext
from pagoda.kv_cache_interface import MambaSpec
from pagoda.model import ops
from pagoda.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagoda.model.layers.mamba.metadata import MambaMetadata
from pagoda.model.layers.mamba.ops_ref import causal_conv1d_ref, ssm_scan_ref

# The HF config attribute of each mixer size: (Mamba2Config's, the hybrids' such as BambaConfig's).
_MAMBA2, _HYBRID = 0, 1
_HF_NAMES = {
    "num_heads": ("num_heads", "mamba_n_heads"),
    "head_dim": ("head_dim", "mamba_d_head"),
    "num_groups": ("n_groups", "mamba_n_groups"),
    "state_size": ("state_size", "mamba_d_state"),
    "conv_kernel": ("conv_kernel", "mamba_d_conv"),
    "expand": ("expand", "mamba_expand"),
    "use_bias": ("use_bias", "mamba_proj_bias"),
    "use_conv_bias": ("use_conv_bias", "mamba_conv_bias"),
    "eps": ("layer_norm_epsilon", "rms_norm_eps"),
}


@dataclass(frozen=True)
class MambaMixerShape:
    """A mixer's sizes, read from a Mamba2Config (names as there) or a hybrid's `mamba_*` fields."""

    hidden_size: int
    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_kernel: int
    intermediate_size: int
    use_bias: bool
    use_conv_bias: bool
    eps: float
    time_step_limit: tuple[float, float]

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.num_groups * self.state_size

    @classmethod
    def of_mamba2(cls, config: PretrainedConfig) -> MambaMixerShape:
        return cls._read(config, _MAMBA2)

    @classmethod
    def of_hybrid(cls, config: PretrainedConfig) -> MambaMixerShape:
        """Bamba's (and GraniteMoeHybrid's) `mamba_*` fields."""
        return cls._read(config, _HYBRID)

    @classmethod
    def _read(cls, config: PretrainedConfig, column: int) -> MambaMixerShape:
        """The shape from the config attributes named in `column` of `_HF_NAMES`, checked."""
        hf = {field: getattr(config, names[column]) for field, names in _HF_NAMES.items()}
        return cls._checked(
            hidden_size=config.hidden_size,
            num_heads=hf["num_heads"],
            head_dim=hf["head_dim"],
            num_groups=hf["num_groups"],
            state_size=hf["state_size"],
            conv_kernel=hf["conv_kernel"],
            intermediate_size=int(hf["expand"] * config.hidden_size),
            use_bias=bool(hf["use_bias"]),
            use_conv_bias=bool(hf["use_conv_bias"]),
            eps=hf["eps"],
            time_step_limit=tuple(config.time_step_limit),
            activation=config.hidden_act,
        )

    @classmethod
    def _checked(cls, activation: str, **fields) -> MambaMixerShape:
        shape = cls(**fields)
        if activation != "silu":
            raise ConfigError(f"hidden_act {activation!r} is not supported for Mamba-2 layers; only 'silu'")
        if shape.num_heads * shape.head_dim != shape.intermediate_size:
            raise ConfigError(
                f"Mamba-2 heads x head_dim ({shape.num_heads} x {shape.head_dim}) must equal expand x hidden_size "
                f"({shape.intermediate_size})"
            )
        if shape.num_heads % shape.num_groups:
            raise ConfigError(f"n_groups ({shape.num_groups}) must divide the {shape.num_heads} Mamba-2 heads")
        if shape.conv_kernel < 2:
            raise ConfigError(f"conv_kernel must be >= 2, got {shape.conv_kernel}")
        return shape


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    """RMSNorm of y * SiLU(z) over each group of `group_size` channels, in float32 (HF's
    MambaRMSNormGated: the gate is applied before the norm)."""
    h = y.float() * F.silu(z.float())
    grouped = h.view(*h.shape[:-1], -1, group_size)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return weight * grouped.view_as(h).to(y.dtype)


def use_kernels(x: torch.Tensor) -> bool:
    """Whether the mixer runs its Triton kernels on `x` (CUDA) rather than the torch reference."""
    return ops.use_triton(x)


class ConvWeights(nn.Module):
    """The depthwise conv's parameters under HF's names (conv1d.weight [conv_dim, 1, K], conv1d.bias)."""

    def __init__(self, channels: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels), requires_grad=False) if bias else None


class GatedRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if use_kernels(y):
            from pagoda.model.ops import triton_mamba

            return triton_mamba.gated_rms_norm(y, z, self.weight, self.group_size, self.eps)
        return gated_rms_norm(y, z, self.weight, self.group_size, self.eps)


class MambaMixer2(nn.Module):
    def __init__(self, shape: MambaMixerShape, layer_name: str) -> None:
        super().__init__()
        if get_parallel_state().tp_size > 1:
            raise ConfigError("tensor_parallel_size > 1 is not supported for Mamba-2 layers")
        self.shape = shape
        self.layer_name = layer_name
        # The state's element type: the model's (the dtype the layer is built in).
        self.state_dtype = torch.get_default_dtype()
        projection = shape.intermediate_size + shape.conv_dim + shape.num_heads
        self.in_proj = ColumnParallelLinear(shape.hidden_size, projection, bias=shape.use_bias)
        self.conv1d = ConvWeights(shape.conv_dim, shape.conv_kernel, shape.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(shape.num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(shape.num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(shape.num_heads), requires_grad=False)
        self.norm = GatedRMSNorm(shape.intermediate_size, shape.intermediate_size // shape.num_groups, shape.eps)
        self.out_proj = RowParallelLinear(shape.intermediate_size, shape.hidden_size, bias=shape.use_bias)
        low, high = shape.time_step_limit
        self._clamp_dt = low > 0.0 or not math.isinf(high)

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype, checkpoints: bool = False) -> MambaSpec:
        """The state keeps the model's dtype whatever the KV cache's (`dtype`); `checkpoints`:
        one at every block boundary (mamba_cache_mode "align")."""
        shape = self.shape
        return MambaSpec(
            block_size,
            conv_shape=(shape.conv_dim, shape.conv_kernel - 1),
            ssm_shape=(shape.num_heads, shape.head_dim, shape.state_size),
            dtype=self.state_dtype,
            checkpoints=checkpoints,
        )

    def state_views(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's cache [1, blocks, page elements] as (conv states [blocks, conv_dim, K - 1],
        SSM states [blocks, heads, head_dim, state_size]), views into each block's page."""
        shape = self.shape
        conv_elements = shape.conv_dim * (shape.conv_kernel - 1)
        ssm_elements = shape.num_heads * shape.head_dim * shape.state_size
        pages = cache[0]
        conv = pages[:, :conv_elements].unflatten(-1, (shape.conv_dim, shape.conv_kernel - 1))
        ssm = pages[:, conv_elements : conv_elements + ssm_elements].unflatten(
            -1, (shape.num_heads, shape.head_dim, shape.state_size)
        )
        return conv, ssm

    def forward(self, hidden_states: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        """hidden_states [T, hidden] -> [T, hidden]; advances each request's state past its tokens."""
        shape = self.shape
        metadata = context.attn_metadata[self.layer_name]
        assert isinstance(metadata, MambaMetadata)
        conv_states, ssm_states = self.state_views(context.kv_caches[self.layer_name])
        num_tokens = hidden_states.shape[0]
        projected = self.in_proj(hidden_states)
        gate, xbc, dt = projected.split([shape.intermediate_size, shape.conv_dim, shape.num_heads], dim=-1)
        rows = (
            metadata.query_start_loc,
            metadata.initial_state_indices,
            metadata.state_indices,
            metadata.has_initial_state,
        )
        weight = self.conv1d.weight.view(shape.conv_dim, shape.conv_kernel)
        group_state = shape.num_groups * shape.state_size
        if use_kernels(hidden_states):
            from pagoda.model.ops.triton_mamba import causal_conv1d, ssm_scan

            decode = metadata.max_query_len == 1
            xbc = causal_conv1d(xbc, weight, self.conv1d.bias, conv_states, *rows, decode=decode)
            x, B, C = xbc.split([shape.intermediate_size, group_state, group_state], dim=-1)
            y = ssm_scan(
                x.view(num_tokens, shape.num_heads, shape.head_dim),
                dt,
                self.dt_bias,
                self.A_log,
                B.view(num_tokens, shape.num_groups, shape.state_size),
                C.view(num_tokens, shape.num_groups, shape.state_size),
                self.D,
                ssm_states,
                *rows,
                decode=decode,
                dt_limit=shape.time_step_limit if self._clamp_dt else None,
            )
        else:
            xbc = causal_conv1d_ref(xbc, weight, self.conv1d.bias, conv_states, *rows)
            x, B, C = xbc.split([shape.intermediate_size, group_state, group_state], dim=-1)
            dt = F.softplus(dt.float() + self.dt_bias.float())
            if self._clamp_dt:
                dt = dt.clamp(*shape.time_step_limit)
            y = ssm_scan_ref(
                x.reshape(num_tokens, shape.num_heads, shape.head_dim),
                dt,
                -torch.exp(self.A_log.float()),
                B.reshape(num_tokens, shape.num_groups, shape.state_size),
                C.reshape(num_tokens, shape.num_groups, shape.state_size),
                self.D,
                ssm_states,
                *rows,
            )
        y = self.norm(y.reshape(num_tokens, shape.intermediate_size), gate)
        return self.out_proj(y)
