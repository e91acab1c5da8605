"""Quantize-time searches with a C++ version: one function each, which runs hf_aoq's extension
on CPU where it is built and the same search in torch ops otherwise (and on other devices).
Tensor types call these, never the extension."""
from __future__ import annotations

import torch

from . import cpu_ext

_STEPS = (-1, 0, 1)  # scale and centre indices tried around the nearest ones


def int4dq_search(x, mask, a0, b0, dlo, dstep, clo, cstep, k: int, levels: int = 15):
    """Int4DQ's search: for groups x float32 [N, G, g] (a partial last group padded, `mask`
    [G, g] its real columns, or None), the nearest scale and centre indices a0, b0 [N, G] and
    the rows' grids (dlo, dstep, clo, cstep, each [N, 1]), each group's best (a, b) among the
    nearest indices and their neighbours, and its codes q [N, G, g] on that grid (K = k real
    columns). Returns (a, b, q); the C++ and the torch search choose the same.

    `levels`: the largest code (15 for Int4DQ; 7 and 3 for IntxDQTensor's 3- and 2-bit codes),
    w = (q - levels / 2) * d + c."""
    ext = cpu_ext.load() if x.device.type == "cpu" else None
    if ext is not None:  # about 10x faster than the torch ops
        n, _, g = x.shape
        rows = torch.cat([dlo, dstep, clo, cstep], dim=1).contiguous()
        flat = x.reshape(n, -1).contiguous()
        q, a, b = ext.int4dq_search(flat, a0.to(torch.uint8).contiguous(), b0.to(torch.uint8).contiguous(), rows, g, k,
                                     levels)
        return a, b, q
    return _torch_search(x, mask, a0, b0, dlo, dstep, clo, cstep, levels)


def _torch_search(x, mask, a0, b0, dlo, dstep, clo, cstep, levels=15):
    best = None
    for da in _STEPS:
        for db in _STEPS:
            a, b = (a0 + da).clamp(0, 15), (b0 + db).clamp(0, 15)
            d = dlo + a * dstep
            c = clo + b * cstep
            q, err = _codes_and_error(x, d, c, mask, levels)
            if best is None:
                best = [a, b, q, err]
            else:
                better = err < best[3]
                best = [torch.where(better, a, best[0]), torch.where(better, b, best[1]),
                        torch.where(better[..., None], q, best[2]), torch.where(better, err, best[3])]
    return best[0], best[1], best[2]


def group_codes(x, d, c, levels: int = 15):
    """Codes in [0, levels] of values x on groups of scale d and centre c (broadcasting):
    round((x - c) / d + levels / 2); where d is not positive every code stands for c, and the
    code is (levels + 1) / 2 (8 for 4-bit codes)."""
    safe = torch.where(d > 0, d, torch.ones_like(d))
    fill = torch.full_like(x, float((levels + 1) // 2))
    return torch.where(d > 0, torch.round((x - c) / safe + levels / 2), fill).clamp_(0, levels)


def _codes_and_error(x, d, c, mask, levels=15):
    """Codes of groups x [N, G, g] on the grid (d, c) [N, G], and each group's squared error."""
    d3, c3 = d[..., None], c[..., None]
    q = group_codes(x, d3, c3, levels)
    diff = ((q - levels / 2) * d3 + c3 - x).square_()
    if mask is not None:
        diff = diff * mask
    return q, diff.sum(-1)
