"""Qwen2 (biased q/k/v) and Qwen3 (per-head q/k RMSNorm, head_dim from the config)."""

from __future__ import annotations

from transformers import PretrainedConfig

from pagoda.model.models.decoder import DecoderForCausalLM, DecoderOptions


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_options(cls, config: PretrainedConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True)


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_options(cls, config: PretrainedConfig) -> DecoderOptions:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(qkv_bias=attention_bias, o_proj_bias=attention_bias, qk_norm=True)
