"""Hugging Face transformers models on the same weights Pagoda serves: the peer in
benchmarks and the numerical reference in tests."""

from __future__ import annotations

import functools
import gc
import os
from unittest import mock

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig


def load_hf_from_gguf(path: str, dtype: torch.dtype = torch.float32) -> tuple[PretrainedConfig, torch.nn.Module, dict]:
    """transformers' own reading of a GGUF file: (config, model in eval mode, dequantized tensors).

    Built with `from_config` + `load_gguf_checkpoint`, which is what `from_pretrained(gguf_file=...)`
    does, without the `accelerate` dependency that path requires."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model_dir, file_name = os.path.split(path)
    config = AutoConfig.from_pretrained(model_dir, gguf_file=file_name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # transformers builds gguf's tensor-name map once per module of the model (397 for
    # SmolLM2: 7 of its 20 s); the map depends only on the architecture and layer count.
    with mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
        tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise RuntimeError(f"GGUF weights do not fit the model: missing {missing}, unexpected {unexpected}")
    return config, model.to(dtype).eval(), tensors


def load_hf_model(model: str, load_format: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """The HF model for a resolved Pagoda model (an HF directory, a .gguf file, or a dummy shape
    name or directory), in eval mode on `device`. Dummy models get the same config and HF's own
    random weights, built on the device (an 8B model initialised on the CPU takes minutes)."""
    if load_format == "dummy":
        from pagoda.model.loader import load_hf_config

        with torch.device(device):
            return AutoModelForCausalLM.from_config(load_hf_config(model, "dummy"), dtype=dtype).eval()
    if load_format == "gguf":
        return load_hf_from_gguf(model, dtype)[1].to(device)
    return AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()


def free_device_memory() -> None:
    """Return the memory of engines just dropped (their KV cache, graphs) before a peer loads."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
