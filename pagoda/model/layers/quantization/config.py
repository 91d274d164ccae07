"""Which quantization a model runs with: the user's `quantization` setting against the
checkpoint's own `quantization_config` (config.json), and a GGUF's `gguf_weights` against the
device and the file's tensor types, resolved to a `QuantizationConfig`."""

from __future__ import annotations

from typing import Any

import torch

from pagoda.config import ConfigError
from pagoda.model.layers.quantization.base import QuantizationConfig
from pagoda.model.layers.quantization.fp8 import Fp8Config
from pagoda.model.layers.quantization.fp8_ops import fp8_supported
from pagoda.model.layers.quantization.gguf_blocks import GGUFBlockConfig
from pagoda.model.layers.quantization.int4 import Int4Config

# Checkpoint `quant_method`s that load as FP8.
CHECKPOINT_FP8_METHODS = ("fp8", "compressed-tensors")
# compressed-tensors `ignore` entries that name modules never quantized here anyway: the LM head
# and a mixture-of-experts router.
_ALWAYS_UNQUANTIZED = ("lm_head", "mlp.gate", "block_sparse_moe.gate")


def checkpoint_quantization(hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's `quantization_config` as a dict, None if it has none."""
    value = getattr(hf_config, "quantization_config", None)
    if value is None or isinstance(value, dict):
        return value
    return value.to_dict()


def resolve_quantization(
    quantization: str | None, hf_config: Any, load_format: str, device: torch.device
) -> str | None:
    """The method the model runs with ("fp8" or None, as ModelConfig checked), resolved against
    the checkpoint (an FP8 checkpoint runs in FP8) and checked against the device."""
    published = checkpoint_quantization(hf_config)
    if published is not None and load_format != "dummy":
        build_quantization_config("fp8", hf_config, load_format)
        quantization = "fp8"
    if quantization == "fp8" and not fp8_supported(device):
        capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise ConfigError(
            f"quantization 'fp8' needs a GPU of compute capability >= 8.9 (Ada, Hopper), this one is {capability}"
        )
    return quantization


# ATen CPU capabilities where the int4 kernel beats the dequantized linear ("quantized" still
# runs elsewhere). Its AVX2 build (ATEN_CPU_CAPABILITY=avx2 on the AVX-512 machine) took 138 us
# at one token for a 3072 x 576 layer against 97 us for float32 F.linear (whose MKL code kept
# AVX-512 there); its scalar build took 1.5 ms. On a real AVX2 CPU (2 cores of an AMD EPYC,
# benchmarks/cpu_decode.py, SmolLM2): bf16 with int4 decoded a single stream at 80.0 ms a
# token against 83.7 for float32 dequantized, and 32 streams at 48.7 tok/s against 79.1.
INT4_FAST_CAPABILITIES = ("AVX512",)


def resolve_gguf_weights(
    gguf_weights: str,
    model: str,
    load_format: str,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str | None,
    batch_invariant: bool,
    tensor_parallel_size: int = 1,
) -> str:
    """How the GGUF's linear weights load: "quantized" (torch's int4 kernel), "blocks" (the
    file's blocks, Pagoda's own AVX2 / AVX-512 kernels) or "dequantized". "auto" picks the int4 kernel where it
    is fast (`INT4_FAST_CAPABILITIES`) and costs no precision a bf16 model has not given up
    already (its activations round to bf16), else the blocks where their kernels run (they
    dequantize exactly, so any dtype), else dequantizes; an explicit choice that cannot run is
    an error saying why."""
    if gguf_weights == "dequantized":
        return gguf_weights
    if load_format != "gguf":
        if gguf_weights != "auto":
            raise ConfigError(f"gguf_weights {gguf_weights!r} is for GGUF models, this one loads as {load_format!r}")
        return "dequantized"
    int4_reason = _why_not_int4(model, device, quantization, batch_invariant)
    if gguf_weights == "quantized" and int4_reason is not None:
        raise ConfigError(f"gguf_weights 'quantized' {int4_reason}: use gguf_weights='dequantized'")
    fast = torch.backends.cpu.get_cpu_capability() in INT4_FAST_CAPABILITIES
    if gguf_weights == "quantized" or (
        gguf_weights == "auto" and int4_reason is None and fast and dtype == torch.bfloat16
    ):
        return "quantized"
    blocks_reason = _why_not_blocks(model, device, quantization, batch_invariant, tensor_parallel_size)
    if gguf_weights == "blocks" and blocks_reason is not None:
        raise ConfigError(f"gguf_weights 'blocks' {blocks_reason}: use gguf_weights='dequantized'")
    return "blocks" if blocks_reason is None else "dequantized"


def _why_not_cpu_kernel(device: torch.device, quantization: str | None, batch_invariant: bool) -> str | None:
    """What stops any of the CPU's 4-bit kernels, whatever the file holds."""
    if device.type != "cpu":
        return f"runs on the CPU, the device is {device.type!r}"
    if quantization is not None:
        return f"cannot combine with quantization {quantization!r}"
    if batch_invariant:
        return "is not batch-invariant (its kernel's sums may depend on the batch)"
    return None


def _why_not_int4(model: str, device: torch.device, quantization: str | None, batch_invariant: bool) -> str | None:
    from pagoda.model.loader.gguf_loader import int4_obstacle

    return _why_not_cpu_kernel(device, quantization, batch_invariant) or int4_obstacle(model)


def _why_not_blocks(
    model: str, device: torch.device, quantization: str | None, batch_invariant: bool, tensor_parallel_size: int
) -> str | None:
    from pagoda.model.layers.quantization import gguf_kernels
    from pagoda.model.loader.gguf_loader import block_type_obstacle

    reason = _why_not_cpu_kernel(device, quantization, batch_invariant)
    if reason is None and tensor_parallel_size > 1:
        reason = f"runs on one rank (its layers keep each row's blocks whole), tensor_parallel_size is {tensor_parallel_size}"
    reason = reason or gguf_kernels.unavailable_reason() or block_type_obstacle(model)
    if reason is None and gguf_kernels.load() is None:
        reason = "could not build its kernels (the log says why)"
    return reason


def check_kv_cache_dtype(kv_cache_dtype: str, device: torch.device) -> None:
    """An FP8 KV cache needs e4m3 conversions in the attention kernels: sm_89 and newer."""
    if kv_cache_dtype == "fp8" and not fp8_supported(device):
        capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise ConfigError(
            f"kv_cache_dtype 'fp8' needs a GPU of compute capability >= 8.9 (Ada, Hopper), this one is {capability}"
        )


def build_quantization_config(
    quantization: str | None, hf_config: Any, load_format: str, gguf_weights: str = "dequantized", model: str = ""
) -> QuantizationConfig | None:
    """The layers' quantization: a GGUF's int4 groups or blocks (of the file at `model`) where
    they load so, the checkpoint's FP8 layout where it publishes one (except for dummy weights,
    which are drawn in the model dtype), else FP8 quantized at load if asked."""
    if load_format == "gguf" and gguf_weights == "quantized":
        return Int4Config()
    if load_format == "gguf" and gguf_weights == "blocks":
        from pagoda.model.loader.gguf_loader import linear_block_type, vocab_block_types

        return GGUFBlockConfig(linear_block_type(model), *vocab_block_types(model))
    if quantization is None:
        return None
    published = checkpoint_quantization(hf_config)
    if published is None or load_format == "dummy":
        return Fp8Config()
    method = published.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_config(published)
    if method == "fp8":
        return _hf_fp8_config(published)
    raise ConfigError(
        f"quantization_config.quant_method {method!r} is not supported; supported: {', '.join(CHECKPOINT_FP8_METHODS)}"
    )


def _hf_fp8_config(published: dict[str, Any]) -> Fp8Config:
    """HF's fine-grained FP8: `weight_scale_inv` per block (or one per tensor)."""
    scheme = published.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ConfigError(f"quantization_config.activation_scheme must be 'dynamic' or 'static', got {scheme!r}")
    _check_ignored(published.get("modules_to_not_convert") or [], "modules_to_not_convert")
    block = published.get("weight_block_size")
    return Fp8Config(
        serialized=True,
        weight_strategy="block" if block else "tensor",
        block_size=tuple(block) if block else None,
        static_input=scheme == "static",
        weight_scale_name="weight_scale_inv",
        input_scale_name="activation_scale",
    )


def _compressed_tensors_config(published: dict[str, Any]) -> Fp8Config:
    """compressed-tensors' float-quantized layout: one config group of 8-bit float weights."""
    groups = published.get("config_groups") or {}
    if len(groups) != 1:
        raise ConfigError(f"quantization_config.config_groups must hold one group, got {len(groups)}")
    ((group_name, group),) = groups.items()
    weights = group.get("weights") or {}
    field = f"quantization_config.config_groups.{group_name}"
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise ConfigError(f"{field}.weights must be 8-bit float (FP8), got {weights}")
    strategy = weights.get("strategy")
    block = weights.get("block_structure") if strategy == "block" else None
    if strategy not in ("tensor", "channel", "block"):
        raise ConfigError(f"{field}.weights.strategy must be tensor, channel or block, got {strategy!r}")
    activations = group.get("input_activations") or {}
    static_input = bool(activations) and not activations.get("dynamic", True)
    if static_input and activations.get("strategy") != "tensor":
        raise ConfigError(f"{field}.input_activations: static scales must be per tensor, got {activations}")
    _check_ignored(published.get("ignore") or [], "ignore")
    return Fp8Config(
        serialized=True,
        weight_strategy=strategy,
        block_size=tuple(block) if block else None,
        static_input=static_input,
    )


def _check_ignored(modules: list[str], field: str) -> None:
    """Unquantized modules are only those never quantized here: other entries would leave a
    bf16 tensor where an FP8 layer expects FP8, so they are refused rather than misread."""
    unexpected = [name for name in modules if not any(kind in name for kind in _ALWAYS_UNQUANTIZED)]
    if unexpected:
        raise ConfigError(
            f"quantization_config.{field} lists modules kept unquantized that are not supported yet: {unexpected}"
        )
