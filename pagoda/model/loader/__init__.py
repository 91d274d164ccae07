"""Model loading: resolve where the model comes from, read its config and tokenizer, build it.

Sources: Hugging Face directories (config.json + safetensors), GGUF files (llama.cpp; weights
dequantized, or 4-bit linears kept 4-bit on the CPU: gguf_int4), and dummy models (a published
shape or an HF directory, random weights).
"""

from pagoda.model.loader.generation_config import load_sampling_defaults
from pagoda.model.loader.hf_config import load_hf_config
from pagoda.model.loader.model_loader import get_model
from pagoda.model.loader.source import (
    DEFAULT_MODEL_NAME,
    LOAD_FORMATS,
    default_model_path,
    resolve_model,
    resolve_tokenizer,
)
from pagoda.model.loader.tokenizer import get_eos_token_ids, load_tokenizer

__all__ = [
    "DEFAULT_MODEL_NAME",
    "LOAD_FORMATS",
    "default_model_path",
    "get_eos_token_ids",
    "get_model",
    "load_hf_config",
    "load_sampling_defaults",
    "load_tokenizer",
    "resolve_model",
    "resolve_tokenizer",
]
