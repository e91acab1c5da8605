"""tinygemm's int4 weight layout (aten `_convert_weight_to_int4pack` on NVIDIA GPUs), in torch.

Written from the layout PyTorch documents in aten/src/ATen/native/cuda/int4mm.cu, so that the
CUDA packing can be checked, and undone, on any machine. Codes c[n][k] in [0, 15] (K a
multiple of T * 16, T = inner k-tiles in {2, 4, 8}; N a multiple of 8) become int32 words
W[N/8][K/(T*16)][32][T/2]: word W[nt][ko][t][j] is lane t's part of k-tiles 2j and 2j + 1 of
super-tile ko, for row n = 8 nt + t // 4. With k0 = (ko T + 2j) 16 + 2 (t % 4), its eight nibbles,
lowest first, hold the codes at k = k0, k0 + 8, k0 + 16, k0 + 24 (nibbles 0-3) and k0 + 1,
k0 + 9, k0 + 17, k0 + 25 (nibbles 4-7). The kernel dequantizes a code as
(c - 8) * scale + zero in bfloat16 and accumulates bf16 products in float32.
ROCm builds use other tiles (16-row n-tiles); this is the NVIDIA layout only.
"""
from __future__ import annotations

import torch



def inner_k_tiles(k: int) -> int:
    """The inner k-tiles the CUDA packing uses for K (0: K is not a multiple of 32)."""
    for tiles in (8, 4, 2):
        if k % (tiles * 16) == 0:
            return tiles
    return 0


def _source_index(n: int, k: int, tiles: int, device) -> torch.Tensor:
    """int64 [N/8, K/(T*16), 32, T/2, 8]: the flat index n * K + k of each nibble's code."""
    nt = torch.arange(n // 8, device=device).view(-1, 1, 1, 1, 1)
    ko = torch.arange(k // (tiles * 16), device=device).view(1, -1, 1, 1, 1)
    t = torch.arange(32, device=device).view(1, 1, -1, 1, 1)
    j = torch.arange(tiles // 2, device=device).view(1, 1, 1, -1, 1)
    i = torch.arange(8, device=device).view(1, 1, 1, 1, -1)
    off = (i % 4) * 8 + i // 4  # nibble i holds the code at k0 + off: 0, 8, 16, 24, 1, 9, 17, 25
    row = nt * 8 + t // 4
    col = (ko * tiles + 2 * j) * 16 + 2 * (t % 4) + off
    return row * k + col


def tinygemm_pack(codes: torch.Tensor, tiles: int | None = None) -> torch.Tensor:
    """uint8 codes [N, K] -> int32 words in tinygemm's layout (bit for bit aten's CUDA packer)."""
    n, k = codes.shape
    tiles = tiles or inner_k_tiles(k)
    if n % 8 or not tiles or k % (tiles * 16):
        raise ValueError(f"tinygemm packs [N, K] codes with N % 8 == 0 and K % {16 * (tiles or 2)} == 0, got {n}x{k}")
    src = _source_index(n, k, tiles, codes.device)
    nib = codes.reshape(-1).to(torch.int64)[src]
    shifts = torch.arange(0, 32, 4, device=codes.device)
    words = (nib << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def tinygemm_unpack(words: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of `tinygemm_pack`: uint8 codes [N, K] from the int32 words (read as bits)."""
    tiles = words.shape[-1] * 2
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, device=words.device)
    nib = (w.unsqueeze(-1) >> shifts) & 15
    codes = torch.empty(n * k, dtype=torch.uint8, device=words.device)
    codes[_source_index(n, k, tiles, words.device).reshape(-1)] = nib.reshape(-1).to(torch.uint8)
    return codes.view(n, k)


def tinygemm_mm(x: torch.Tensor, words: torch.Tensor, group_size: int, scale_and_zero: torch.Tensor) -> torch.Tensor:
    """What `_weight_int4pack_mm` computes, up to float32 summation order: x bf16 [M, K] times
    the dequantized weight ((c - 8) * scale + zero, rounded to bf16), accumulated in float32,
    returned as bf16 [M, N]."""
    k = x.shape[1]
    n = scale_and_zero.shape[1]
    codes = tinygemm_unpack(words, n, k).float() - 8
    sz = scale_and_zero.to(torch.bfloat16).float()  # [K/g, N, 2]
    scale = sz[..., 0].t().repeat_interleave(group_size, dim=1)
    zero = sz[..., 1].t().repeat_interleave(group_size, dim=1)
    w = (codes * scale + zero).to(torch.bfloat16)
    return (x.to(torch.bfloat16).float() @ w.float().t()).to(torch.bfloat16)
