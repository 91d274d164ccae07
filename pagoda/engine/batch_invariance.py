"""What `batch_invariant=True` covers, checked when the engine config is built.

In this mode a request's numbers never depend on the other requests of its steps, their count,
how its prompt was chunked or whether its prefix came from the cache:
- every linear layer and the LM head run `triton_gemv.batch_invariant_linear` (one split of K
  per weight shape, summed in one order, whatever the token count; the tiles around it follow
  the count, which changes no row's bits);
- attention runs one tile configuration for prefill chunks, decodes and verify steps, over key
  tiles anchored at position 0, without split-K (`triton_unified_attention.INVARIANT_TILES`);
- cascade attention is off (its prefix/suffix split depends on the batch);
- RMSNorm, rotary, activations and the sampler already compute one row per program or per row.
Models whose forward has batch-dependent parts are refused here, naming the setting: FP8
weights (per-tensor activation scales of the whole batch), mixture-of-experts layers (experts
sorted over the batch's tokens), state-space layers (chunked scans), vision towers, LoRA,
Gemma's norms (torch reductions), embedding models, and the torch attention backend (SDPA).
"""

from __future__ import annotations

from pagoda.config import ConfigError, EngineConfig

# Architectures whose every forward kernel is covered (see the module docstring).
BATCH_INVARIANT_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


def check_batch_invariant(config: EngineConfig) -> None:
    """Raise ConfigError naming the first setting batch-invariant mode cannot honour; turn
    cascade attention off. A no-op when the mode is off."""
    model_config = config.model_config
    if not model_config.batch_invariant:
        return
    if config.device_config.attention_backend != "triton":
        raise ConfigError(
            "batch_invariant needs attention_backend 'triton' (on the CPU: TRITON_INTERPRET=1), "
            f"got {config.device_config.attention_backend!r}"
        )
    if model_config.quantization is not None:
        raise ConfigError(
            f"batch_invariant does not cover quantization {model_config.quantization!r} "
            "(its activation scales span the batch): leave quantization unset"
        )
    if model_config.is_embedding_model:
        raise ConfigError("batch_invariant is for generation: task must be 'generate'")
    architectures = getattr(model_config.hf_config, "architectures", None) or []
    if not set(architectures) & set(BATCH_INVARIANT_ARCHITECTURES):
        raise ConfigError(
            f"batch_invariant covers architectures {', '.join(BATCH_INVARIANT_ARCHITECTURES)}; "
            f"model is {', '.join(architectures) or model_config.hf_config.model_type} "
            "(mixture-of-experts, state-space, vision and Gemma models are refused)"
        )
    if config.lora_config is not None:
        raise ConfigError("batch_invariant does not cover LoRA adapters: enable_lora must be off")
    parallel = config.parallel_config
    if parallel.tensor_parallel_size > 1 and parallel.disable_custom_all_reduce:
        raise ConfigError(
            "batch_invariant with tensor_parallel_size > 1 needs the one-shot all-reduce "
            "(fixed summation order): disable_custom_all_reduce must be off"
        )
    config.scheduler_config.disable_cascade_attn = True
