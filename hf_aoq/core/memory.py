"""Giving memory back to the operating system while a model is quantized on load.

Two kinds of memory outlive the float weights that quantize-on-load has finished with:

* freed heap memory, which glibc keeps for reuse (`return_freed_memory` trims it), and
* the pages of the memory-mapped checkpoint that reading a weight faulted in. They stay in the
  process's resident set until the mapping is closed, which transformers does only at the end of
  loading, so without help a quantize-on-load peaks at the float checkpoint's size plus the
  quantized model's (`release_file_pages` drops them).

Dropping mapped pages is only safe for pages that still hold the file's bytes: a later read then
faults them back in from the page cache or the disk, with the same contents. A private mapping
(safetensors maps its files copy-on-write) may also hold pages that were written to, whose only
copy is in this process; `release_file_pages` reads `/proc/self/pagemap` and never drops those,
nor anything outside a mapping of the named files. Everything here is Linux-only and does nothing
elsewhere.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys

__all__ = ["return_freed_memory", "release_file_pages", "mapped_file_ranges"]

_LINUX = sys.platform.startswith("linux")
_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4
# /proc/<pid>/pagemap: one little-endian u64 per virtual page. Bit 63: present in RAM; bit 62:
# swapped out; bit 61: a file page or shared anonymous page (clear for a private copy made by a
# write). A page is dropped only if it is neither in RAM nor in swap, or is the file's own page.
_SWAPPED = 1 << 62
_FILE_OR_SHARED = 1 << 61


def _load_libc():
    if not _LINUX:
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()


def return_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc's malloc_trim).

    glibc keeps freed memory for reuse; the float weights and temporaries of quantizing sit
    between the long-lived quantized tensors, so without this the resident size grows towards
    the float model's size although no float weight is alive any more.
    """
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def mapped_file_ranges(paths) -> list[tuple[int, int]]:
    """[(start, end)] of this process's mappings of any of `paths` (resolved), from /proc/self/maps."""
    if not _LINUX:
        return []
    wanted = {os.path.realpath(os.fspath(p)) for p in paths}
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].rstrip("\n") in wanted:
                    start, end = (int(x, 16) for x in parts[0].split("-"))
                    ranges.append((start, end))
    except OSError:
        return []
    return ranges


def _clean_runs(pagemap, start: int, end: int):
    """Runs [a, b) of pages in [start, end) that are safe to drop: neither in RAM nor in swap,
    or the file's own page (not a private copy made by a write, in RAM or swapped out)."""
    import torch  # hf_aoq needs torch anyway; imported here to keep this module light

    chunk = 1 << 18  # pages per read (2 MiB of pagemap)
    for base in range(start, end, chunk * _PAGE):
        n = min(chunk, (end - base) // _PAGE)
        pagemap.seek((base // _PAGE) * 8)
        data = pagemap.read(n * 8)
        if len(data) != n * 8:
            raise OSError("short read of /proc/self/pagemap")
        e = torch.frombuffer(bytearray(data), dtype=torch.int64)
        # Bit 63 is the sign bit: present pages are negative.
        held = (e < 0) | ((e & _SWAPPED) != 0)
        keep = held & ((e & _FILE_OR_SHARED) == 0)
        if not bool(keep.any()):
            yield base, base + n * _PAGE
            continue
        # Boundaries between kept pages and droppable runs.
        flags = torch.cat([torch.ones(1, dtype=torch.bool), keep, torch.ones(1, dtype=torch.bool)]).to(torch.int8)
        edges = torch.diff(flags)
        starts = (edges == -1).nonzero().flatten().tolist()  # kept -> droppable
        stops = (edges == 1).nonzero().flatten().tolist()  # droppable -> kept
        for a, b in zip(starts, stops):
            yield base + a * _PAGE, base + b * _PAGE


def release_file_pages(paths, within: tuple[int, int] | None = None) -> int:
    """Drop this process's resident pages of its mappings of `paths` that still hold the file's
    bytes, only those overlapping the address range `within` = (start, end) if given; returns
    the bytes of address range released (0 where this cannot be done safely).

    The data stays correct: a dropped page is read again from the file when it is next touched.
    Pages a write turned into private copies are kept. Unless /proc/self/pagemap can be read to
    tell which those are, nothing is dropped.
    """
    if _LIBC is None:
        return 0
    ranges = mapped_file_ranges(paths)
    if within is not None:
        lo = within[0] // _PAGE * _PAGE
        hi = -(-within[1] // _PAGE) * _PAGE
        ranges = [(max(a, lo), min(b, hi)) for a, b in ranges if a < hi and lo < b]
    if not ranges:
        return 0
    released = 0
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
            for start, end in ranges:
                for a, b in _clean_runs(pagemap, start, end):
                    if _LIBC.madvise(ctypes.c_void_p(a), b - a, _MADV_DONTNEED) == 0:
                        released += b - a
    except OSError:
        return released
    return released
