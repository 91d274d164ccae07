"""A GGUF file's metadata and tensor table, read in one pass with `struct`.

`gguf.GGUFReader` builds a numpy memmap view for every value, which for a 49k-entry vocabulary
and its merges took about 6 s per reading, and a load read the file three times. Here metadata
becomes plain Python values in well under a second, once per process for an unchanged file;
tensor bytes stay memory-mapped until they are dequantized.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagoda.config import ConfigError

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# GGUF metadata value type -> struct format of one little-endian scalar (also a numpy type code).
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table: `shape` in GGUF order (fastest-varying dimension first) and
    the absolute offset of its bytes in the file."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass(frozen=True)
class GGUFFile:
    path: str
    metadata: Mapping[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]

    def value(self, key: str) -> Any:
        """A metadata value (a number, a string or a list), None if absent."""
        return self.metadata.get(key)

    def tensor_names(self) -> set[str]:
        return {tensor.name for tensor in self.tensors}


class _Cursor:
    """Reads little-endian values from a buffer, failing with the file named on a short read."""

    def __init__(self, buffer: Any, path: str) -> None:
        self.buffer, self.path, self.pos = buffer, path, 0

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buffer):
            raise ConfigError(f"model: {self.path} is not a complete GGUF file (it ends inside its header)")
        values = struct.unpack_from("<" + fmt, self.buffer, self.pos)
        self.pos += size
        return values

    def scalar(self, fmt: str) -> Any:
        return self.unpack(fmt)[0]

    def string(self) -> str:
        length = self.scalar("Q")
        end = self.pos + length
        if end > len(self.buffer):
            raise ConfigError(f"model: {self.path} is not a complete GGUF file (a string runs past its end)")
        text = bytes(self.buffer[self.pos : end]).decode("utf-8", errors="replace")
        self.pos = end
        return text

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.unpack("IQ")
            if item_type == _STRING:
                return [self.string() for _ in range(count)]
            if item_type in _SCALAR_FORMATS:
                dtype = np.dtype("<" + _SCALAR_FORMATS[item_type])
                array = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.pos)
                self.pos += array.nbytes
                return array.tolist()
            return [self.value(item_type) for _ in range(count)]  # nested arrays
        if value_type not in _SCALAR_FORMATS:
            raise ConfigError(f"model: {self.path} has a metadata value of unknown GGUF type {value_type}")
        return self.scalar(_SCALAR_FORMATS[value_type])


def _read(path: str) -> GGUFFile:
    if os.path.getsize(path) == 0:
        raise ConfigError(f"model: {path} is not a complete GGUF file (it is empty)")
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        cursor = _Cursor(memoryview(buffer), path)
        try:
            if bytes(buffer[:4]) != _MAGIC:
                raise ConfigError(f"model: {path} is not a GGUF file (no GGUF magic)")
            cursor.pos = 4
            version, tensor_count, kv_count = cursor.unpack("IQQ")
            if version not in _SUPPORTED_VERSIONS:
                raise ConfigError(f"model: {path} is GGUF version {version}; supported: {list(_SUPPORTED_VERSIONS)}")
            metadata: dict[str, Any] = {}
            for _ in range(kv_count):
                key = cursor.string()
                metadata[key] = cursor.value(cursor.scalar("I"))
            table = []
            for _ in range(tensor_count):
                name = cursor.string()
                shape = cursor.unpack(f"{cursor.scalar('I')}Q")
                table.append((name, shape, *cursor.unpack("IQ")))
        finally:
            cursor.buffer.release()
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = tuple(
        GGUFTensorInfo(name, shape, ggml_type, data_start + offset) for name, shape, ggml_type, offset in table
    )
    if len({tensor.name for tensor in tensors}) != len(tensors):
        raise ConfigError(f"model: {path} lists a tensor name twice")
    return GGUFFile(path, types.MappingProxyType(metadata), tensors)


@functools.lru_cache(maxsize=8)
def _read_cached(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return _read(path)


def read_gguf_file(path: str) -> GGUFFile:
    """The file's metadata and tensor table; read once per process while the file is unchanged."""
    real_path = os.path.realpath(path)
    stat = os.stat(real_path)
    return _read_cached(real_path, stat.st_size, stat.st_mtime_ns)
