"""A GGUF file's metadata and tensors, read fast: the fields as plain Python values, the tensors as views of
one read-only memory map.

gguf.GGUFReader makes a numpy view for every element of every metadata array; SmolLM2's vocabulary and
merges are ~100k strings, so it took 3.9 s per open on an AVX2 host, and a worker opens its file two or
three times (weights, tokenizer, config). This reads the same layout with `struct` over the mapped bytes
in about a tenth of a second, and gives tensors the shapes and dtypes GGUFReader gives them, so that
`gguf.quants.dequantize` takes them as they are.

Layout (little-endian): magic "GGUF", version, tensor count, field count; the fields (key, type, value);
the tensor infos (name, dims innermost first, type, offset); the tensor data at the next multiple of
`general.alignment` (32 by default).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

# value type -> (struct format, size) for the scalar types; 8 is a string, 9 an array
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9
_PLAIN_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                 GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                 GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                 GGMLQuantizationType.I64: np.int64}


class GGUFFormatError(ValueError):
    """The bytes are not a well-formed GGUF file (or end early)."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # as the file lists them: innermost first
    n_bytes: int
    data: np.ndarray  # GGUFReader's view: the element dtype for plain types, else uint8 [..., bytes per row]


class GGUFFile:
    """fields: key -> int, float, bool, str or list; tensors: in file order."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._map = np.memmap(self.path, mode="r")
        self._buf = memoryview(self._map)
        self._pos = 0
        if bytes(self._take(4)) != b"GGUF":
            raise GGUFFormatError("no GGUF magic at the start")
        version, num_tensors, num_fields = self._unpack("<IQQ", 20)
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} (2 and 3 are read)")
        self.fields: dict[str, object] = {}
        for _ in range(num_fields):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I", 4)[0])
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I", 4)
            if n_dims > 8:
                raise GGUFFormatError(f"tensor {name!r} has {n_dims} dimensions")
            dims = self._unpack(f"<{n_dims}Q", 8 * n_dims)
            raw_type, offset = self._unpack("<IQ", 12)
            infos.append((name, dims, raw_type, offset))
        alignment = int(self.fields.get("general.alignment", 32))
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"alignment {alignment} is not a power of two")
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise GGUFFormatError("two tensors share a name")

    def _take(self, n: int) -> memoryview:
        end = self._pos + n
        if n < 0 or end > len(self._buf):
            raise GGUFFormatError(f"the file ends at byte {len(self._buf)}, inside its metadata")
        out = self._buf[self._pos:end]
        self._pos = end
        return out

    def _unpack(self, fmt: str, size: int) -> tuple:
        return struct.unpack(fmt, self._take(size))

    def _string(self) -> str:
        (n,) = self._unpack("<Q", 8)
        return str(self._take(n), "utf-8")

    def _value(self, kind: int):
        if kind in _SCALARS:
            fmt, size = _SCALARS[kind]
            return self._unpack(fmt, size)[0]
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise GGUFFormatError(f"unknown metadata value type {kind}")
        item_kind, count = self._unpack("<IQ", 12)
        if item_kind in _NUMPY:
            item_size = np.dtype(_NUMPY[item_kind]).itemsize
            if count > (len(self._buf) - self._pos) // item_size:
                raise GGUFFormatError(f"an array of {count} values runs past the end of the file")
            return np.frombuffer(self._take(count * item_size), dtype=_NUMPY[item_kind]).tolist()
        if count > (len(self._buf) - self._pos) // 8:  # every item takes at least 8 bytes
            raise GGUFFormatError(f"an array of {count} values runs past the end of the file")
        return [self._value(item_kind) for _ in range(count)]

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], raw_type: int, offset: int) -> GGUFTensor:
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFFormatError(f"tensor {name!r} has unknown type {raw_type}") from None
        n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = n_elems * type_size // block_size
        np_dims = tuple(reversed(dims))
        dtype = _PLAIN_DTYPES.get(qtype, np.uint8)
        if dtype is np.uint8:
            np_dims = quant_shape_to_byte_shape(np_dims, qtype)
        begin = start + offset
        raw = self._map[begin:begin + n_bytes]
        if raw.nbytes != n_bytes:  # the file ends early: left short, so that loading names the tensor
            return GGUFTensor(name, qtype, dims, n_bytes, raw)
        return GGUFTensor(name, qtype, dims, n_bytes, raw.view(dtype).reshape(np_dims))
