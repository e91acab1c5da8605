"""The GGUF container (version 3, as ggml's docs/gguf.md specifies it), read and written from the
spec: a header, typed key/value metadata, a table of tensor infos, then the tensor data, each
tensor at an offset that is a multiple of `general.alignment` (32 unless the file says otherwise).
All integers are little-endian. The blocks inside a tensor are hf_aoq.convert.gguf's business.

    "GGUF" magic, uint32 version, uint64 tensor_count, uint64 kv_count
    kv_count x   (string key, uint32 value type, value)
    tensor_count x (string name, uint32 n_dims, uint64 ne[n_dims], uint32 ggml type, uint64 offset)
    padding to the alignment, then the data section
    string = uint64 length + UTF-8 bytes; array = uint32 element type + uint64 count + elements

`read_gguf` maps the file and checks every length, type, shape and offset against the file's size
before any tensor is made (FormatError naming the file and the field); `write_gguf` writes to a
hidden name beside the target and renames it into place.
"""
from __future__ import annotations

import mmap
import os
import secrets
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..core.errors import FormatError, short

MAGIC = b"GGUF"
VERSION = 3
DEFAULT_ALIGNMENT = 32

# Metadata value types.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_SCALARS = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i", FLOAT32: "<f",
            BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}

# ggml tensor types hf_aoq reads or writes: id -> (name, values per block, bytes per block).
F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, BF16 = 0, 1, 2, 3, 8, 12, 14, 30
GGML_TYPES = {F32: ("F32", 1, 4), F16: ("F16", 1, 2), Q4_0: ("Q4_0", 32, 18), Q4_1: ("Q4_1", 32, 20),
              Q8_0: ("Q8_0", 32, 34), Q4_K: ("Q4_K", 256, 144), Q6_K: ("Q6_K", 256, 210), BF16: ("BF16", 1, 2)}
# Names of the other types ggml defines, so that a refusal can say what the file holds.
OTHER_TYPE_NAMES = {6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 13: "Q5_K", 15: "Q8_K",
                    16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
                    22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M"}


def type_name(ggml_type: int) -> str:
    return GGML_TYPES[ggml_type][0] if ggml_type in GGML_TYPES else OTHER_TYPE_NAMES.get(ggml_type, f"type {ggml_type}")


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file: its ggml type, its shape in torch order (the reverse of GGUF's
    ne[]: [rows, columns] for a matrix) and its raw bytes, uint8 [rows, bytes per row]."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    data: torch.Tensor


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, object]   # key -> value (str, int, float, bool, or a list of them)
    types: dict[str, int]         # key -> value type (for arrays, ARRAY)
    tensors: dict[str, GGUFTensor]
    alignment: int


# ---------------------------------------------------------------------- reading
class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise FormatError(f"{self.path}: {what}: the file ends at byte {len(self.buf)}, {n} more bytes "
                              f"were expected at byte {self.pos} (truncated?)")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, vtype: int, what: str):
        fmt = _SCALARS[vtype]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar(UINT64, what)
        raw = bytes(self.take(n, what))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"{self.path}: {what}: not UTF-8 text") from None

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in _SCALARS:
            return self.scalar(vtype, what)
        if vtype == STRING:
            return self.string(what)
        if vtype == ARRAY and depth == 0:
            etype = self.scalar(UINT32, what)
            n = self.scalar(UINT64, what)
            if etype in _SCALARS and etype != BOOL:
                size = struct.calcsize(_SCALARS[etype])
                raw = self.take(n * size, what)
                return np.frombuffer(raw, dtype=np.dtype(_SCALARS[etype])).tolist()
            if etype not in _SCALARS and etype != STRING:
                raise FormatError(f"{self.path}: {what}: array of value type {etype} (not a scalar or string)")
            if n > len(self.buf):
                raise FormatError(f"{self.path}: {what}: {n} elements cannot fit in the file")
            return [self.value(etype, f"{what}[{i}]", 1) for i in range(n)]
        raise FormatError(f"{self.path}: {what}: unknown value type {vtype}")


def read_gguf(path) -> GGUFFile:
    """The GGUF file at `path`, its tensors viewing the mapped file (no copy)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            buf = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)) if size else memoryview(b"")
    except OSError as e:
        raise FormatError(f"{path}: cannot read ({e.strerror or e})") from None
    c = _Cursor(buf, path)
    magic = bytes(c.take(4, "magic"))
    if magic != MAGIC:
        raise FormatError(f"{path}: magic {short(magic)}, expected b'GGUF' (not a GGUF file)")
    version = c.scalar(UINT32, "version")
    if version not in (2, 3):
        raise FormatError(f"{path}: version {version}: hf_aoq reads GGUF versions 2 and 3")
    n_tensors, n_kv = c.scalar(UINT64, "tensor_count"), c.scalar(UINT64, "metadata_kv_count")
    if n_tensors > size or n_kv > size:
        raise FormatError(f"{path}: tensor_count {n_tensors} / metadata_kv_count {n_kv} cannot fit in {size} bytes")
    metadata, types = {}, {}
    for i in range(n_kv):
        key = c.string(f"metadata key {i}")
        vtype = c.scalar(UINT32, f"metadata {key!r} value type")
        if key in metadata:
            raise FormatError(f"{path}: metadata key {key!r} appears twice")
        metadata[key], types[key] = c.value(vtype, f"metadata {key!r}"), vtype
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment % 8:
        raise FormatError(f"{path}: metadata 'general.alignment' {short(alignment)}: expected a positive multiple of 8")
    infos = []
    for i in range(n_tensors):
        name = c.string(f"tensor info {i} name")
        n_dims = c.scalar(UINT32, f"tensor {name!r} n_dims")
        if not 1 <= n_dims <= 4:
            raise FormatError(f"{path}: tensor {name!r}: n_dims {n_dims}, expected 1 to 4")
        ne = [c.scalar(UINT64, f"tensor {name!r} ne[{d}]") for d in range(n_dims)]
        ggml_type = c.scalar(UINT32, f"tensor {name!r} type")
        offset = c.scalar(UINT64, f"tensor {name!r} offset")
        infos.append((name, ne, ggml_type, offset))
    data_start = -(-c.pos // alignment) * alignment
    tensors = {}
    warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
    for name, ne, ggml_type, offset in infos:
        where = f"{path}: tensor {name!r}"
        if name in tensors:
            raise FormatError(f"{where}: appears twice")
        if ggml_type not in GGML_TYPES:
            known = OTHER_TYPE_NAMES.get(ggml_type, "not a ggml type")
            raise FormatError(f"{where}: ggml type {ggml_type} ({known}): hf_aoq reads "
                              f"{', '.join(n for n, _, _ in GGML_TYPES.values())}")
        _, per_block, block_bytes = GGML_TYPES[ggml_type]
        if ne[0] == 0 or ne[0] % per_block or any(d == 0 for d in ne):
            raise FormatError(f"{where}: ne {ne}: a {type_name(ggml_type)} row needs a positive multiple of "
                              f"{per_block} values")
        row_bytes = ne[0] // per_block * block_bytes
        rows = int(np.prod(ne[1:], dtype=np.uint64)) if len(ne) > 1 else 1
        if offset % alignment:
            raise FormatError(f"{where}: offset {offset} is not a multiple of the alignment {alignment}")
        start, nbytes = data_start + offset, rows * row_bytes
        if start + nbytes > size:
            raise FormatError(f"{where}: its {nbytes} bytes at offset {offset} run past the end of the file "
                              f"({size} bytes; truncated?)")
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=start) if nbytes else torch.empty(0, dtype=torch.uint8)
        shape = tuple(reversed(ne))
        tensors[name] = GGUFTensor(name, ggml_type, shape, raw.view(rows, row_bytes))
    spans = sorted((data_start + off, GGML_TYPES[t][2] * (ne[0] // GGML_TYPES[t][1])
                    * (int(np.prod(ne[1:])) if len(ne) > 1 else 1), n) for n, ne, t, off in infos)
    for (s0, n0, a), (s1, _, b) in zip(spans, spans[1:]):
        if s0 + n0 > s1:
            raise FormatError(f"{path}: tensors {a!r} and {b!r} overlap in the data section")
    return GGUFFile(path, metadata, types, tensors, alignment)


# ---------------------------------------------------------------------- writing
def _pack_value(vtype: int, value, key: str) -> bytes:
    if vtype in _SCALARS:
        return struct.pack(_SCALARS[vtype], value)
    if vtype == STRING:
        raw = value.encode("utf-8")
        return struct.pack("<Q", len(raw)) + raw
    raise ValueError(f"metadata {key!r}: value type {vtype} is not a scalar or string")


def _pack_kv(key: str, vtype: int, value, etype: int | None = None) -> bytes:
    out = _pack_value(STRING, key, key) + struct.pack("<I", vtype)
    if vtype != ARRAY:
        return out + _pack_value(vtype, value, key)
    out += struct.pack("<IQ", etype, len(value))
    if etype in _SCALARS and etype != BOOL:
        return out + np.asarray(value, dtype=np.dtype(_SCALARS[etype])).tobytes()
    return out + b"".join(_pack_value(etype, v, key) for v in value)


@dataclass
class KV:
    """One metadata entry to write: its value type, and for an array the element type."""

    type: int
    value: object
    element_type: int | None = None


def write_gguf(path, metadata: dict[str, KV], tensors: list[tuple[str, int, tuple[int, ...], torch.Tensor]],
               alignment: int = DEFAULT_ALIGNMENT) -> None:
    """Write a GGUF file: `metadata` {key: KV} in order, then `tensors` [(name, ggml type, torch
    shape, raw uint8 bytes)]. Atomic: a hidden temporary beside `path`, renamed into place."""
    path = Path(path)
    if alignment != DEFAULT_ALIGNMENT:
        metadata = {**metadata, "general.alignment": KV(UINT32, alignment)}
    head = [MAGIC, struct.pack("<IQQ", VERSION, len(tensors), len(metadata))]
    head += [_pack_kv(k, kv.type, kv.value, kv.element_type) for k, kv in metadata.items()]
    offset, offsets = 0, []
    for name, ggml_type, shape, raw in tensors:
        offsets.append(offset)
        head.append(_pack_value(STRING, name, name) + struct.pack("<I", len(shape))
                    + struct.pack(f"<{len(shape)}Q", *reversed(shape)) + struct.pack("<IQ", ggml_type, offset))
        offset += -(-raw.numel() // alignment) * alignment
    header = b"".join(head)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(b"\0" * (-len(header) % alignment))
            for (_, _, _, raw), _off in zip(tensors, offsets):
                data = raw.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
                f.write(data)
                f.write(b"\0" * (-len(data) % alignment))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
