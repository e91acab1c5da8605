"""Undo any int4 packing that only moves nibbles around, without knowing its layout.

aten's int4 packings differ by device and even by CPU instruction set (AVX512 and AVX2 builds
tile differently), so hard-coding their layouts would make checkpoints depend on the machine
that saved them. Instead we ask the packer where every nibble goes: pack the base-16 digits of
each element's index, one digit per pass, and read back for every packed nibble the index it
came from. Unpacking is then one scatter.
"""
from __future__ import annotations

from typing import Callable

import torch


def nibble_sources(n: int, k: int, pack: Callable[[torch.Tensor], torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
    """For each byte that `pack` writes for an (n, k) code matrix: the flat source index of its
    low and of its high nibble. `pack` takes int32 codes in [0, 15] and returns any tensor."""
    count = n * k
    # int32 indices where they fit: every pass is memory-bound, so half the bytes is half the time.
    index_dtype = torch.int32 if count < 2**31 else torch.int64
    index = torch.arange(count, dtype=index_dtype, device=device).view(n, k)
    low = high = None
    shift = 0
    while (1 << shift) < count or shift == 0:
        codes = ((index >> shift) & 15).to(torch.int32)
        packed = pack(codes).contiguous().view(torch.uint8).reshape(-1).to(index_dtype)
        if packed.numel() * 2 != count:
            raise ValueError(f"packing of a ({n}, {k}) int4 matrix wrote {packed.numel()} bytes, not {count // 2}")
        lo, hi = (packed & 15) << shift, (packed >> 4) << shift
        low = lo if low is None else low.bitwise_or_(lo)
        high = hi if high is None else high.bitwise_or_(hi)
        shift += 4
    return low, high


def unpack_nibbles(packed: torch.Tensor, n: int, k: int, pack: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Recover the (n, k) uint8 codes that `pack` turned into `packed`."""
    low, high = nibble_sources(n, k, pack, packed.device)
    data = packed.contiguous().view(torch.uint8).reshape(-1)
    codes = torch.empty(n * k, dtype=torch.uint8, device=packed.device)
    codes[low] = data & 15
    codes[high] = data >> 4
    return codes.view(n, k)
