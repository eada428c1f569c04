"""A GGUF file's header read straight off a memory map: its metadata and its tensors' layout.

Contract: `GGUFHeader(path)` gives what the `gguf` package's `GGUFReader` gives for the same file,
the values equal: `fields` maps each metadata key to `ReaderField.contents()` (a Python scalar,
a str, or a flat list; the package's own `GGUF.*` pseudo-fields are not included), and `tensors`
lists each tensor's name, GGML type id, dimensions in the file's order (innermost first) and its
stored data as a read-only numpy view of the mapped file, typed and shaped as the package types
and shapes `ReaderTensor.data` (F32/F16/F64/I8..I64 as their numpy types in numpy's order;
every other type as uint8 rows of its blocks, `quant_shape_to_byte_shape`). Nothing of a
tensor's data is read until its view is. Versions 2 and 3, either byte order; junk (a bad
magic, a truncated header or data section, a duplicate key or tensor name, an unknown value or
tensor type, a bad `general.alignment`) raises ValueError naming what is wrong.

Why not the package's reader: it builds numpy arrays for every scalar and for every string of
a vocabulary (three per token), in every process that opens the file, which takes seconds for a
vocabulary of 262k tokens (Gemma 3); this reads the same header with `struct` (figures in
docs/performance.md).
"""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types (the spec's `gguf_metadata_value_type`)
STRING, ARRAY = 8, 9
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_UINT32 = 4


@functools.cache
def _element_types() -> dict[int, str]:
    """GGML types whose data the package gives as their own numpy type (the rest as uint8 blocks)."""
    import gguf

    kind = gguf.GGMLQuantizationType
    return {
        kind.F32: "f4", kind.F16: "f2", kind.F64: "f8",
        kind.I8: "i1", kind.I16: "i2", kind.I32: "i4", kind.I64: "i8",
    }  # fmt: skip


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of the file, its data not read until `data` is."""

    name: str
    type_id: int  # GGML's type (`gguf.GGMLQuantizationType` value)
    dims: tuple[int, ...]  # the file's order: innermost (a matrix's columns) first
    data: np.ndarray  # read-only view of the mapped file (module docstring)


class GGUFHeader:
    """The metadata and tensor layout of one GGUF file (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as file:
            try:
                self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as exc:  # an empty file cannot be mapped
                raise ValueError(f"not a GGUF file ({exc})") from exc
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        try:
            self._parse()
        except struct.error as exc:
            raise ValueError(f"the header is truncated or corrupt ({exc})") from exc
        except UnicodeDecodeError as exc:
            raise ValueError(f"a name or string is not UTF-8 ({exc})") from exc

    def _parse(self) -> None:
        if self._map[:4] != MAGIC:
            raise ValueError("GGUF magic invalid")
        (version,) = struct.unpack_from("<I", self._map, 4)
        self._order = "<"
        if version & 0xFFFF == 0:  # written in the other byte order (as the package detects it)
            self._order = ">"
            (version,) = struct.unpack_from(">I", self._map, 4)
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (supported: 2, 3)")
        self.version: int = version
        num_tensors, num_fields = struct.unpack_from(self._order + "QQ", self._map, 8)
        offset = 24
        self.fields: dict[str, Any] = {}
        alignment_type = None
        for _ in range(num_fields):
            key, offset = self._string(offset)
            (value_type,) = struct.unpack_from(self._order + "I", self._map, offset)
            if key in self.fields:
                raise ValueError(f"metadata key {key} appears twice")
            self.fields[key], offset = self._value(value_type, offset + 4)
            if key == "general.alignment":
                alignment_type = value_type
        layouts = []
        names: set[str] = set()
        for _ in range(num_tensors):
            name, offset = self._string(offset)
            if name in names:
                raise ValueError(f"tensor {name} appears twice")
            names.add(name)
            (num_dims,) = struct.unpack_from(self._order + "I", self._map, offset)
            dims = struct.unpack_from(f"{self._order}{num_dims}Q", self._map, offset + 4)
            offset += 4 + 8 * num_dims
            type_id, data_offset = struct.unpack_from(self._order + "IQ", self._map, offset)
            offset += 12
            layouts.append((name, type_id, tuple(dims), data_offset))
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if alignment_type not in (None, _UINT32) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment must be a power of two as a uint32, not {alignment!r}")
        self.data_offset = -(-offset // alignment) * alignment
        self.tensors = [self._tensor(*layout) for layout in layouts]

    def _string(self, offset: int) -> tuple[str, int]:
        (length,) = struct.unpack_from(self._order + "Q", self._map, offset)
        end = offset + 8 + length
        if end > len(self._map):
            raise ValueError(f"a string at byte {offset} runs past the end of the file")
        return str(self._map[offset + 8 : end], "utf-8"), end

    def _value(self, value_type: int, offset: int) -> tuple[Any, int]:
        """The value of `value_type` at `offset` as `ReaderField.contents()` gives it, and the offset after it."""
        if value_type == STRING:
            return self._string(offset)
        scalar = _SCALAR_FORMATS.get(value_type)
        if scalar is not None:
            (value,) = struct.unpack_from(self._order + scalar, self._map, offset)
            return value, offset + struct.calcsize(scalar)
        if value_type != ARRAY:
            raise ValueError(f"unknown metadata value type {value_type} at byte {offset}")
        item_type, length = struct.unpack_from(self._order + "IQ", self._map, offset)
        offset += 12
        item = _SCALAR_FORMATS.get(item_type)
        if item is not None:  # numbers: one view of the file
            dtype = np.dtype(self._order + item)
            end = offset + length * dtype.itemsize
            if end > len(self._map):
                raise ValueError(f"an array at byte {offset} runs past the end of the file")
            return np.frombuffer(self._map, dtype, length, offset).tolist(), end
        values: list[Any] = []
        for _ in range(length):
            value, offset = self._value(item_type, offset)
            if item_type == ARRAY:  # nested arrays come flat, as the package gives them
                values += value
            else:
                values.append(value)
        return values, offset

    def _tensor(self, name: str, type_id: int, dims: tuple[int, ...], data_offset: int) -> StoredTensor:
        import gguf

        try:
            kind = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(f"tensor {name} has the unknown GGML type {type_id}") from None
        block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
        num_elements = int(np.prod(dims, dtype=np.int64))
        shape = tuple(reversed(dims))
        element = _element_types().get(type_id)
        if element is not None:
            dtype = np.dtype(self._order + element)
        else:
            if dims and dims[0] % block_size:
                raise ValueError(f"tensor {name}: {dims[0]} columns are not whole blocks of {block_size}")
            dtype = np.dtype(np.uint8)
            shape = gguf.quant_shape_to_byte_shape(shape, kind)
        num_bytes = num_elements * type_size // block_size
        start = self.data_offset + data_offset
        if start + num_bytes > len(self._bytes):
            raise ValueError(f"tensor {name}'s data runs past the end of the file (truncated?)")
        data = self._bytes[start : start + num_bytes].view(dtype).reshape(shape)
        return StoredTensor(name, type_id, dims, data)
