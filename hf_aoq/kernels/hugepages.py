"""Quantized weights' large CPU buffers on transparent huge pages (2 MiB), where Linux offers them.

Why: the CPU GEMVs read a block of weight rows as several interleaved streams and ask, for each
line they read, for the same line of the next block (simd.h): at 4 KiB pages those requests
cross a page every few lines, and each new page is a TLB walk before the line can be fetched.
Measured on the 2-vCPU AVX-512 Xeon VM (weights cycled from DRAM, batch 1, [5632, 2048]): int8
536-598 -> 523-530 us a call, float8 563-577 -> 526-535; a 22-layer model's decode 0.5-4% (int8)
and 4-11% (float8) faster in three old/new pairs (docs/performance.md, "Huge pages for the weights"). The cost is one
copy of the codes at load.
torch's CPU allocator asks for huge pages only under THP_MEM_ALLOC_ENABLE=1, and Linux's default
THP mode on most distributions is "madvise" (huge pages only where a program asks).

`on_huge_pages(t)` copies a CPU tensor of at least 2 MiB into an anonymous mapping whose start
is 2 MiB-aligned and advised MADV_HUGEPAGE before its first touch, so the copy faults in huge
pages (the whole 2 MiB pages inside the tensor; its last partial page stays small, so no memory
is added). The mapping lives as long as the tensor's storage (torch.frombuffer holds it). Where
that cannot be done (not Linux, THP "never", HF_AOQ_HUGE_PAGES=0, a small tensor) the tensor
comes back contiguous and 64-byte aligned (`aligned_contiguous`), as before. Values never change.
"""
from __future__ import annotations

import functools
import mmap
import os
import sys

import torch

from .common import aligned_contiguous

HUGE_PAGE = 2 << 20
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_mode() -> str | None:
    """The bracketed word of Linux's THP setting ("always", "madvise", "never"), or None."""
    try:
        with open(_THP_MODE) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether weights are placed on huge pages here (decided once per process)."""
    if os.environ.get("HF_AOQ_HUGE_PAGES", "1") == "0":
        return False
    return sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE") and _thp_mode() in ("always", "madvise")


def describe() -> str:
    """Where placed weights live here, for reports: "2 MiB pages (THP madvise)" or "4 KiB pages (why)"."""
    if available():
        return f"2 MiB pages (THP {_thp_mode()})"
    if os.environ.get("HF_AOQ_HUGE_PAGES", "1") == "0":
        return "4 KiB pages (HF_AOQ_HUGE_PAGES=0)"
    mode = _thp_mode()
    return f"4 KiB pages (THP {mode})" if mode else "4 KiB pages (no transparent huge pages)"


def is_on_huge_pages(t: torch.Tensor) -> bool:
    """Whether `t` is a contiguous CPU tensor starting on a huge-page boundary (what
    `on_huge_pages` returns for a large tensor, so placing twice copies once)."""
    return t.device.type == "cpu" and t.is_contiguous() and t.data_ptr() % HUGE_PAGE == 0


def _to_move(t: torch.Tensor) -> bool:
    """A large CPU buffer not yet on huge pages (given that `available()`)."""
    return t.device.type == "cpu" and t.nbytes >= HUGE_PAGE and not t.requires_grad and not is_on_huge_pages(t)


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values in a buffer on huge pages (see the module docstring), or `t` contiguous and
    aligned where that does not apply (a tensor already on huge pages comes back as it is)."""
    if not available() or not _to_move(t):
        return aligned_contiguous(t)
    nbytes = t.nbytes
    try:
        # One huge page more than needed, so that a 2 MiB-aligned start lies inside; the pages
        # never touched (before that start, after the tensor) cost address space only.
        buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = torch.frombuffer(buf, dtype=torch.uint8)
        start = -raw.data_ptr() % HUGE_PAGE
        whole = nbytes // HUGE_PAGE * HUGE_PAGE
        buf.madvise(mmap.MADV_HUGEPAGE, start, whole)
    except (OSError, ValueError):
        return aligned_contiguous(t)
    out = raw[start:start + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def fields_on_huge_pages(w):
    """`w` (an AOQTensor) with each large CPU tensor field on huge pages; `w` itself when none
    moves."""
    if not available():
        return w
    moved = {n: on_huge_pages(t) for n, t in w.tensor_fields().items() if _to_move(t)}
    return w.replace(**moved) if moved else w
