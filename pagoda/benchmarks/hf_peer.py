"""Hugging Face transformers models on the same weights Pagoda serves: the peer in
benchmarks and the numerical reference in tests."""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig


def load_hf_from_gguf(path: str, dtype: torch.dtype = torch.float32) -> tuple[PretrainedConfig, torch.nn.Module, dict]:
    """transformers' own reading of a GGUF file: (config, model in eval mode, dequantized tensors).

    Built with `from_config` + `load_gguf_checkpoint`, which is what `from_pretrained(gguf_file=...)`
    does, without the `accelerate` dependency that path requires."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model_dir, file_name = os.path.split(path)
    config = AutoConfig.from_pretrained(model_dir, gguf_file=file_name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise RuntimeError(f"GGUF weights do not fit the model: missing {missing}, unexpected {unexpected}")
    return config, model.to(dtype).eval(), tensors


def load_hf_model(model: str, load_format: str, dtype: torch.dtype) -> torch.nn.Module:
    """The HF model for a Pagoda model path (an HF directory or a .gguf file), in eval mode."""
    if load_format == "gguf":
        return load_hf_from_gguf(model, dtype)[1]
    return AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()
