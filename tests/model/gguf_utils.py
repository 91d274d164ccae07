"""Helpers of the GGUF tests: random quantized blocks, small GGUF files, a model's weight bytes."""

from __future__ import annotations

import gguf
import numpy as np

from pagoda import LLM


def quantized_blocks(rows: int, cols: int, qtype: gguf.GGMLQuantizationType, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((rows, cols)) * 0.05 + rng.standard_normal((rows, 1)) * 0.02).astype(np.float32)
    return gguf.quants.quantize(weight, qtype)


def write_gguf(path: str, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]) -> str:
    writer = gguf.GGUFWriter(path, "llama")
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def weight_bytes(llm: LLM) -> int:
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}  # a tied head counts once
    return sum(t.numel() * t.element_size() for t in tensors.values())
