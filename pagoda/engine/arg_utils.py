"""Engine arguments: flat user settings resolved against the model into an `EngineConfig`.

`create_engine_config(**kwargs)` is the single place where user settings (from `LLM(...)`
or CLI flags) are checked and resolved against the model (its path, load format, HF config),
so every later component can trust its config without re-validating. It lives here, not in
`pagoda.config`, so that the config dataclasses stay a leaf module that imports nothing from
pagoda (the model loader imports the config; the config must not import the loader).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pagoda import cpu_platform
from pagoda.config import (
    CacheConfig,
    CompilationConfig,
    ConfigError,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagoda.engine.batch_invariance import check_batch_invariant
from pagoda.kv_transfer.disagg.params import private_ipc_address
from pagoda.lora.config import LORA_ARGUMENTS, resolve_lora_config
from pagoda.model.layers.quantization import gguf_kernels
from pagoda.model.layers.quantization.config import (
    check_kv_cache_dtype,
    resolve_gguf_weights,
    resolve_quantization,
)
from pagoda.model.loader import load_hf_config, load_sampling_defaults, resolve_model, resolve_tokenizer
from pagoda.pooling.config import resolve_pooler_config, resolve_task
from pagoda.spec_decode.draft_config import resolve_draft_model, resolve_eagle_head

# A GGUF model's dtype on the CPU under "auto" where the block kernels run: its linears stay 4-bit
# blocks whatever the dtype, and the kernels (and the CPU decode step) compute in float32; bfloat16
# would take torch's int4 kernel instead. On the 2-core AVX-512 BF16 machine (SmolLM2, 2026-12-08,
# benchmarks/cpu_decode.py): float32 blocks 7.7-8.7 ms a token single stream, 358-379 tok/s at 32
# streams; bfloat16 int4 30.0-30.8 ms and 180-182 tok/s.
GGUF_CPU_AUTO_DTYPE = torch.float32

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def create_engine_config(**kwargs: Any) -> EngineConfig:
    """Build from flat keyword arguments (the `LLM(...)` / CLI flag names)."""
    groups = {
        "model_config": ModelConfig,
        "cache_config": CacheConfig,
        "scheduler_config": SchedulerConfig,
        "parallel_config": ParallelConfig,
        "device_config": DeviceConfig,
        "compilation_config": CompilationConfig,
    }
    split: dict[str, dict[str, Any]] = {name: {} for name in groups}
    # Fields the engine derives (hf_config, default_sampling, the scheduler's copy of max_model_len)
    # are not settable.
    derived = {
        ("model_config", "hf_config"),
        ("model_config", "default_sampling"),
        ("model_config", "pooler_config"),
        ("scheduler_config", "max_model_len"),
    }
    owners = {
        f.name: name
        for name, klass in groups.items()
        for f in dataclasses.fields(klass)
        if (name, f.name) not in derived
    }
    speculative = kwargs.pop("speculative_config", None)
    pooler = kwargs.pop("pooler_config", None)
    lora_kwargs = {name: kwargs.pop(name) for name in LORA_ARGUMENTS if name in kwargs}
    for key, value in kwargs.items():
        if key not in owners:
            raise ConfigError(f"unknown engine argument {key!r}")
        split[owners[key]][key] = value

    device_config = DeviceConfig(**split["device_config"])
    model_config = ModelConfig(**split["model_config"])
    model_config.model, model_config.load_format = resolve_model(model_config.model, model_config.load_format)
    if model_config.tokenizer is not None:
        model_config.tokenizer = resolve_tokenizer(model_config.tokenizer)
    model_config.hf_config = load_hf_config(model_config.model, model_config.load_format)
    model_config.default_sampling = load_sampling_defaults(
        model_config.model, model_config.load_format, model_config.generation_config
    )
    model_config.dtype = _resolve_dtype(model_config.dtype, device_config, model_config.load_format)
    model_config.quantization = resolve_quantization(
        model_config.quantization, model_config.hf_config, model_config.load_format, torch.device(device_config.device)
    )
    model_config.gguf_weights = resolve_gguf_weights(
        model_config.gguf_weights,
        model_config.model,
        model_config.load_format,
        torch.device(device_config.device),
        model_config.dtype,
        model_config.quantization,
        model_config.batch_invariant,
        split["parallel_config"].get("tensor_parallel_size", 1),
    )
    model_config.task = resolve_task(model_config.task, model_config.hf_config)
    if model_config.is_embedding_model:
        model_config.pooler_config = resolve_pooler_config(model_config.model, model_config.hf_config, pooler)
    elif pooler is not None:
        raise ConfigError("pooler_config is for embedding models: pass task='embed'")

    limit = model_config.derived_max_model_len
    if model_config.max_model_len is None:
        model_config.max_model_len = limit
    elif not 1 <= model_config.max_model_len <= limit:
        raise ConfigError(
            f"max_model_len must be in [1, {limit}] (the model's max_position_embeddings), "
            f"got {model_config.max_model_len}"
        )

    scheduler_kwargs = split["scheduler_config"]
    scheduler_kwargs["max_model_len"] = model_config.max_model_len
    scheduler_config = SchedulerConfig(**scheduler_kwargs)
    if scheduler_config.async_scheduling is None:
        scheduler_config.async_scheduling = device_config.is_cuda
    if scheduler_config.max_num_batched_tokens is None:
        default_budget = 8192 if scheduler_config.enable_chunked_prefill else model_config.max_model_len
        scheduler_config.max_num_batched_tokens = max(default_budget, scheduler_config.max_num_seqs)
    if (
        not scheduler_config.enable_chunked_prefill
        and scheduler_config.max_num_batched_tokens < model_config.max_model_len
    ):
        raise ConfigError(
            "max_num_batched_tokens must be >= max_model_len "
            f"({model_config.max_model_len}) when chunked prefill is off, "
            f"got {scheduler_config.max_num_batched_tokens}"
        )
    parallel_config = ParallelConfig(**split["parallel_config"])
    parallel_config.check_model(model_config)
    local_gpus = torch.cuda.device_count()
    if (
        device_config.is_cuda
        and parallel_config.distributed_executor_backend == "mp"
        and (parallel_config.world_size > local_gpus)
    ):
        raise ConfigError(
            f"tensor_parallel_size x pipeline_parallel_size ({parallel_config.world_size}) must be <= "
            f"the {local_gpus} visible CUDA devices with distributed_executor_backend 'mp'"
        )
    speculative_config = _resolve_speculative(speculative, model_config, scheduler_config, parallel_config)
    if model_config.is_embedding_model and speculative_config is not None:
        raise ConfigError("speculative_config is for generation; an embedding model (task 'embed') samples nothing")
    if model_config.is_encoder_only and parallel_config.world_size > 1:
        raise ConfigError(
            "encoder-only models (BERT) run on one rank: tensor_parallel_size and pipeline_parallel_size must be 1"
        )
    lora_config = resolve_lora_config(lora_kwargs, model_config)
    cache_config = CacheConfig(**split["cache_config"])
    for name in ("kv_offload_gib", "kv_role"):
        if getattr(cache_config, name) and parallel_config.world_size > 1:
            raise ConfigError(
                f"{name} runs on one rank: tensor_parallel_size x pipeline_parallel_size must be 1, "
                f"got {parallel_config.world_size}"
            )
    if cache_config.kv_role == "producer" and cache_config.kv_transfer_address is None:
        cache_config.kv_transfer_address = private_ipc_address()
    check_kv_cache_dtype(cache_config.kv_cache_dtype, torch.device(device_config.device))
    config = EngineConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        parallel_config=parallel_config,
        device_config=device_config,
        compilation_config=CompilationConfig(**split["compilation_config"]),
        speculative_config=speculative_config,
        lora_config=lora_config,
    )
    check_batch_invariant(config)
    return config


def _resolve_speculative(
    value: SpeculativeConfig | dict[str, Any] | str | None,
    model_config: ModelConfig,
    scheduler_config: SchedulerConfig,
    parallel_config: ParallelConfig,
) -> SpeculativeConfig | None:
    """The speculative config checked against the engine's limits, its draft or head resolved."""
    if value is None:
        return None
    config = SpeculativeConfig.from_value(value)
    k = config.num_speculative_tokens
    budget = scheduler_config.max_num_batched_tokens
    assert budget is not None and model_config.max_model_len is not None
    if k + 1 > budget:
        raise ConfigError(
            f"speculative_config.num_speculative_tokens must be <= max_num_batched_tokens - 1 = {budget - 1} "
            f"(a verify step takes k + 1 tokens per request), got {k}"
        )
    if k + 2 > model_config.max_model_len:
        raise ConfigError(
            f"speculative_config.num_speculative_tokens must be <= max_model_len - 2 = "
            f"{model_config.max_model_len - 2}, got {k}"
        )
    if parallel_config.pipeline_parallel_size > 1:
        raise ConfigError("speculative_config needs pipeline_parallel_size 1 (pipelined verify steps are not built)")
    if model_config.has_recurrent_state:
        raise ConfigError(
            "speculative_config is not supported for state-space models: a verify step would advance "
            "the recurrent state past drafts that are then rejected"
        )
    if config.method == "draft_model":
        config = resolve_draft_model(config, model_config)
    elif config.method in ("eagle", "eagle3"):
        config = resolve_eagle_head(config, model_config)
    return config


def _resolve_dtype(dtype: str | torch.dtype, device_config: DeviceConfig, load_format: str = "auto") -> torch.dtype:
    """ "auto": bfloat16 where the hardware multiplies it natively (CUDA; CPUs with AVX-512 BF16 or
    AMX, where it halves the bytes each step reads), else float32; but a GGUF model on the CPU
    stays float32 where the GGUF block kernels can run (`GGUF_CPU_AUTO_DTYPE`)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if not device_config.is_cuda and load_format == "gguf" and gguf_kernels.unavailable_reason() is None:
            return GGUF_CPU_AUTO_DTYPE
        native_bf16 = device_config.is_cuda or cpu_platform.cpu_has_native_bf16()
        return torch.bfloat16 if native_bf16 else torch.float32
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]
