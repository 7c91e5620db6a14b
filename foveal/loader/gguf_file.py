"""The GGUF container: its metadata and tensor table, read in one pass over a memory map.

Owns: parsing the header (magic, version 2/3, key/value metadata, tensor infos, alignment) into plain
Python values, and numpy views of each tensor's bytes in the map (nothing copied, nothing read that a
caller does not touch). Must not interpret the metadata (gguf_config.py) or dequantize (gguf_loader.py).

Why not `gguf.GGUFReader`: it builds a numpy view per array element, so SmolLM2's 49k-token vocabulary,
scores and 48k merges take 2.8 s on the 2-vCPU host (~7 s while other work shares it); here strings are
sliced from one buffer and numeric arrays are one `np.frombuffer` each (0.17 s). The type tables
(value types, block sizes) are the gguf package's own.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = 0x46554747  # b"GGUF" read little-endian
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_SCALARS = {  # value type -> (struct format, numpy dtype) little-endian
    GGUFValueType.UINT8: ("<B", np.uint8),
    GGUFValueType.INT8: ("<b", np.int8),
    GGUFValueType.UINT16: ("<H", np.uint16),
    GGUFValueType.INT16: ("<h", np.int16),
    GGUFValueType.UINT32: ("<I", np.uint32),
    GGUFValueType.INT32: ("<i", np.int32),
    GGUFValueType.FLOAT32: ("<f", np.float32),
    GGUFValueType.BOOL: ("<?", np.bool_),
    GGUFValueType.UINT64: ("<Q", np.uint64),
    GGUFValueType.INT64: ("<q", np.int64),
    GGUFValueType.FLOAT64: ("<d", np.float64),
}
# tensor types whose elements numpy holds directly (the rest are blocks of bytes)
_PLAIN = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader can take (bad magic, version, truncation, types)."""


@dataclass(slots=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order: fastest-varying dimension first
    n_bytes: int
    offset: int  # of its first byte in the file
    data: np.ndarray  # a view into the map: elements [*reversed(shape)] or uint8 block rows [..., bytes]


@dataclass(slots=True)
class GGUFContents:
    path: str
    version: int
    metadata: dict[str, Any]  # key -> int / float / bool / str / list of those
    tensors: list[GGUFTensor]
    data_offset: int


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.at = buf, 0

    def take(self, n: int) -> memoryview:
        end = self.at + n
        if n < 0 or end > len(self.buf):
            raise GGUFFormatError(
                f"the file ends at byte {len(self.buf)}; {n} more bytes wanted at {self.at}"
            )
        out = self.buf[self.at : end]
        self.at = end
        return out

    def scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self.take(size))[0]

    def string(self) -> str:
        return bytes(self.take(self.scalar("<Q"))).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        try:
            kind = GGUFValueType(kind)
        except ValueError:
            raise GGUFFormatError(f"unknown metadata value type {kind} at byte {self.at}") from None
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            return self.array(item, count)
        return self.scalar(_SCALARS[kind][0])

    def array(self, item: int, count: int) -> list:
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[GGUFValueType(item)][1]).newbyteorder("<")
            raw = self.take(count * dtype.itemsize)
            return np.frombuffer(raw, dtype=dtype, count=count).tolist()
        if item == GGUFValueType.STRING:
            return self._strings(count)
        return [self.value(item) for _ in range(count)]  # arrays of arrays: rare and small

    def _strings(self, count: int) -> list[str]:
        buf, at, out = self.buf, self.at, []
        end = len(buf)
        from_bytes = int.from_bytes
        for _ in range(count):
            if at + 8 > end:
                raise GGUFFormatError(f"the file ends inside a string array (byte {at})")
            n = from_bytes(buf[at : at + 8], "little")
            at += 8
            if at + n > end:
                raise GGUFFormatError(f"the file ends inside a string array (byte {at})")
            out.append(str(buf[at : at + n], "utf-8", "replace"))
            at += n
        self.at = at
        return out


def read_gguf(path: str) -> GGUFContents:
    """Parse `path`'s header; tensor data stay in the memory map (views keep it open)."""
    try:
        mm = np.memmap(path, mode="r")
    except (OSError, ValueError) as e:
        raise GGUFFormatError(f"cannot map {path}: {e}") from e
    cur = _Cursor(memoryview(mm))
    if len(mm) < 24 or cur.scalar("<I") != MAGIC:
        raise GGUFFormatError("not a GGUF file (no GGUF magic at its start)")
    version = cur.scalar("<I")
    if version not in VERSIONS:
        hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise GGUFFormatError(f"GGUF version {version} is not supported{hint}; versions: {VERSIONS}")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        if key in metadata:
            raise GGUFFormatError(f"metadata key {key!r} appears twice")
        metadata[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.scalar("<Q") for _ in range(cur.scalar("<I")))
        kind, offset = cur.scalar("<I"), cur.scalar("<Q")
        try:
            kind = GGMLQuantizationType(kind)
        except ValueError:
            raise GGUFFormatError(f"tensor {name}: unknown ggml type {kind}") from None
        infos.append((name, dims, kind, offset))
    align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise GGUFFormatError(f"general.alignment {align!r} is not a power of two")
    start = -(-cur.at // align) * align
    tensors = [_tensor(mm, start, *info) for info in infos]
    return GGUFContents(path=path, version=version, metadata=metadata, tensors=tensors, data_offset=start)


def _tensor(mm: np.memmap, start: int, name: str, dims: tuple[int, ...], kind, offset: int) -> GGUFTensor:
    block, block_bytes = GGML_QUANT_SIZES[kind]
    n = int(np.prod(dims)) if dims else 1
    if dims and dims[0] % block:
        raise GGUFFormatError(
            f"tensor {name}: {dims[0]} columns are not whole blocks of {block} ({kind.name})"
        )
    n_bytes = n // block * block_bytes
    begin = start + offset
    raw = mm[begin : begin + n_bytes]  # shorter when the file is truncated: the caller checks n_bytes
    rows = tuple(reversed(dims))
    if kind in _PLAIN and raw.nbytes == n_bytes:
        data = raw.view(_PLAIN[kind]).reshape(rows)
    elif raw.nbytes == n_bytes and dims:
        data = raw.reshape(*rows[:-1], dims[0] // block * block_bytes)
    else:
        data = raw
    return GGUFTensor(name=name, tensor_type=kind, shape=dims, n_bytes=n_bytes, offset=begin, data=data)
