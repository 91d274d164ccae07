"""Llama 2/3/3.1 (incl. llama3 RoPE scaling), SmolLM and Mistral: the plain decoder."""

from __future__ import annotations

from pagoda.model.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama's options are the decoder's defaults: biases as `attention_bias` / `mlp_bias` say."""


MistralForCausalLM = LlamaForCausalLM
