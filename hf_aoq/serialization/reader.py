"""A strict safetensors reader that maps the file once and views every tensor in place.

safetensors' own `safe_open(...).get_tensors()` costs about 25 us per tensor on the machines we
measured, several times what the rest of an hf_aoq load costs per tensor, and keeps the last of
two duplicate header keys without a word. This reader parses the header once, refuses whatever
the safetensors format does not allow (duplicate keys, unknown fields, holes or overlaps in the
data, a size that does not match), and returns tensors that view a private, copy-on-write map
of the file, each over its own bytes: nothing is read from disk until it is used, and writing to
a tensor never writes to the file. A file it does not map itself (on a big-endian host, or one
holding a dtype such as F4 that it does not name) is read through safetensors.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
import sys
from dataclasses import dataclass
from typing import NamedTuple

import safetensors
import torch

from ..core.registry import SAFETENSORS_DTYPES
from .common import error, gc_paused, load_json_object, short

# Every dtype safetensors names; those torch has no dtype for (F4 packs two per byte, say) are
# left to safetensors itself.
_SAFETENSORS_NAMES = frozenset(SAFETENSORS_DTYPES) | {
    "U16", "U32", "U64", "F4", "F6_E2M3", "F6_E3M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"
}
_INFO_KEYS = frozenset({"dtype", "shape", "data_offsets"})
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


class Stored(NamedTuple):
    """One tensor as a safetensors header describes it."""

    dtype_name: str  # the safetensors name, "BF16"
    dtype: torch.dtype | None  # None for a dtype this reader does not map (left to safetensors)
    shape: list[int]
    begin: int  # data offsets, relative to the end of the header
    end: int


_new_stored = tuple.__new__  # Stored without its Python-level constructor: one per tensor per load


@dataclass
class Header:
    """A safetensors file's header, checked: every tensor's bytes lie within the file, without
    holes or overlaps (where every dtype is one this reader maps; safetensors checks the rest)."""

    source: str
    size: int  # bytes in the file
    start: int  # where the data begins
    metadata: dict[str, str] | None
    tensors: dict[str, Stored]  # in the order of their data in the file
    known: bool  # every dtype is one this reader maps

    @property
    def mapped(self) -> bool:
        """Whether read_safetensors maps the file itself."""
        return self.known and sys.byteorder == "little"


def read_safetensors(path) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    """(tensors on CPU, the header's `__metadata__` or None). Raises FormatError, naming the
    file and the tensor, for anything that is not a well-formed safetensors file, and OSError
    when the file cannot be read at all."""
    header = read_header(path)
    return read_tensors(header), header.metadata


def read_tensors(header: Header) -> dict[str, torch.Tensor]:
    """The tensors of a file whose header `read_header` returned (on CPU, viewing a private map)."""
    if not header.mapped:
        return _read_with_safetensors(header.source)[0]
    with gc_paused():
        return _map(header)


def read_header(path) -> Header:
    """The checked header of one safetensors file; reads nothing but the header."""
    source = os.fspath(path)
    with gc_paused():
        header = _read_header(source)
    if not header.known:
        _read_with_safetensors(source, tensors=False)  # safetensors checks what this reader cannot
    return header


def _read_header(source: str) -> Header:
    size = os.path.getsize(source)
    with open(source, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise error(source, f"not a safetensors file: {size} bytes is too short for its header")
        (n,) = struct.unpack("<Q", prefix)
        if n > size - 8:
            raise error(source, f"not a safetensors file: header length {n} does not fit in a file of {size} bytes")
        if n > MAX_HEADER_BYTES:
            raise error(source, f"not a safetensors file: header length {n} exceeds the cap of "
                                f"{MAX_HEADER_BYTES} bytes on safetensors headers")
        text = f.read(n)
    try:
        text = text.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(source, f"safetensors header: not valid JSON: not UTF-8 ({e})") from None
    header = load_json_object(text, source, "safetensors header")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and (
        type(metadata) is not dict or not all(type(v) is str for v in metadata.values())
    ):
        raise error(source, f"safetensors __metadata__ must map strings to strings, got {short(metadata)}")

    start, data_bytes = 8 + n, size - 8 - n
    spans = []
    known = True
    for name, info in header.items():
        if type(info) is not dict or info.keys() != _INFO_KEYS:
            raise error(source, f"header entry must have exactly {sorted(_INFO_KEYS)}, got {short(info)}", name)
        dtype_name, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        dtype = SAFETENSORS_DTYPES.get(dtype_name) if type(dtype_name) is str else None
        if dtype is None and not (type(dtype_name) is str and dtype_name in _SAFETENSORS_NAMES):
            raise error(source, f"unknown safetensors dtype {short(dtype_name)}", name)
        if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
            raise error(source, f"shape must be a list of non-negative ints, got {short(shape)}", name)
        if (
            type(offsets) is not list
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise error(source, f"data_offsets must be [begin, end] with 0 <= begin <= end, got {short(offsets)}", name)
        if dtype is None:
            known = False  # its size per element is safetensors' business
        else:
            nbytes = math.prod(shape) * dtype.itemsize
            if offsets[1] - offsets[0] != nbytes:
                raise error(source, f"data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, "
                                    f"but {dtype_name} {shape} needs {nbytes}", name)
        spans.append((offsets[0], offsets[1], name, dtype_name, dtype, shape))
    spans.sort(key=lambda s: (s[0], s[1]))
    if known:
        end = 0
        for begin, stop, name, *_ in spans:
            if begin != end:
                problem = "overlaps the tensor before it" if begin < end else f"leaves a hole of {begin - end} bytes"
                raise error(source, f"data at bytes [{begin}, {stop}) {problem}", name)
            end = stop
        if end != data_bytes:
            problem = "truncated" if end > data_bytes else f"{data_bytes - end} bytes longer than its tensors"
            raise error(source, f"not a complete safetensors file: it is {problem} (tensors end at byte {start + end}, "
                                f"the file has {size})")
    tensors = {name: _new_stored(Stored, (dn, dt, sh, b, e)) for b, e, name, dn, dt, sh in spans}
    return Header(source, size, start, metadata, tensors, known)


def _map(header: Header) -> dict[str, torch.Tensor]:
    source, size, start = header.source, header.size, header.start
    tensors: dict[str, torch.Tensor] = {}
    if not header.tensors:
        return tensors
    try:
        with open(source, "rb") as f:
            # ACCESS_COPY: a private map; writes to a tensor change its pages, never the file.
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as e:  # the file changed under us, say
        raise error(source, f"cannot map the file: {e}") from None
    if len(mapped) != size:
        raise error(source, f"the file changed while it was read ({size} bytes, then {len(mapped)})")
    for name, (_, dtype, shape, begin, stop) in header.tensors.items():
        offset = start + begin
        if begin == stop:
            tensors[name] = torch.empty(shape, dtype=dtype)
        elif offset % dtype.itemsize:  # a writer that did not align its data: copy this tensor
            raw = torch.frombuffer(mapped, dtype=torch.uint8, count=stop - begin, offset=offset)
            tensors[name] = raw.clone().view(dtype).reshape(shape)
        else:
            # Each tensor gets its own storage over its own bytes, as if read one by one.
            count = (stop - begin) // dtype.itemsize
            tensors[name] = torch.frombuffer(mapped, dtype=dtype, count=count, offset=offset).view(shape)
    return tensors


def _read_with_safetensors(source: str, tensors: bool = True):
    try:
        with safetensors.safe_open(source, framework="pt", device="cpu") as f:
            return (f.get_tensors() if tensors else {}), f.metadata()
    except safetensors.SafetensorError as e:
        raise error(source, f"not a readable safetensors file: {short(str(e), 300)}") from None
    except (TypeError, ValueError) as e:  # a dtype this torch cannot represent, say
        raise error(source, f"cannot read its tensors: {short(str(e), 300)}") from e
