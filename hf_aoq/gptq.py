"""GPTQ: error-feedback rounding of one linear's weight on its calibration inputs.

For a weight W [N, K] and calibration inputs X [T, K], rounding input column k of W changes the
output by (w_k - q_k) x_k. GPTQ quantizes the columns in order and, after each, spreads its
rounding error over the columns not yet quantized (through the upper Cholesky factor of the
inverse Gram matrix H^-1, H = X^T X) so that the layer's output on X changes as little as
possible. The result is exactly the tensor type the config makes (same fields, same kernels);
only the codes, and each group's parameters, are chosen with data.

`gptq_sweep` is the one core. A tensor type takes part through a *group quantizer*: called with
a group's columns as the feedback so far has left them, it chooses the group's parameters the
way the type does and returns the function that rounds one column of that group to (codes,
dequantized value). The types here:
  - Int4WeightOnlyConfig (Int4Tensor) and IntxWeightOnlyConfig (IntxTensor: 1-8 bits, any group
    size or per row, symmetric or asymmetric): each group's scale and zero by the config's own
    search (core.primitives.choose_qparams_affine), on the updated weights;
  - Int4DQWeightOnlyConfig (Int4DQTensor): the per-tensor floats and each row's grid of group
    scales and centres are fixed first, from the weight as it is (as Int4DQTensor.from_float
    chooses them); each group then takes its 4-bit scale and centre indices on that grid by the
    type's own search (kernels.search.int4dq_search), on the updated weights;
  - IntxDQWeightOnlyConfig (IntxDQTensor): the same, with 2- or 3-bit codes.
`gptq_quantize(weight, gram, config)` picks the quantizer from the config (GPTQ_CONFIGS).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from .configs import Int4DQWeightOnlyConfig, Int4WeightOnlyConfig, IntxDQWeightOnlyConfig, IntxWeightOnlyConfig
from .configs.intx import INT_DTYPES, _intx_group
from .core.errors import AOQError
from .core.primitives import by_row_chunks, choose_qparams_affine, midpoint, pack_int4
from .core.tensor import AOQTensor
from .kernels.search import group_codes, int4dq_search
from .tensors import int4dq, intxdq
from .tensors.common import check_built
from .tensors.int4 import QMAX, QMIN, Int4Tensor
from .tensors.int4dq import Int4DQTensor
from .tensors.intxdq import IntxDQTensor
from .tensors.intx import IntxTensor, pack_intx

GPTQ_CONFIGS = (Int4WeightOnlyConfig, IntxWeightOnlyConfig, Int4DQWeightOnlyConfig, IntxDQWeightOnlyConfig)

# A group quantizer: (the group's columns [N, w] after the feedback so far, its first column)
# -> a function rounding one column [N] of that group to (codes, dequantized), both float32 [N].
RoundColumn = Callable[[torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]
GroupQuantizer = Callable[[torch.Tensor, int], RoundColumn]


def gptq_sweep(weight: torch.Tensor, gram: torch.Tensor, group_size: int, quantize_group: GroupQuantizer, *,
               damping: float = 0.01, act_order: bool = False, name: str = "weight") -> torch.Tensor:
    """The codes (uint8 [N, K]) GPTQ chooses for `weight` [N, K] on inputs whose Gram matrix is
    `gram` [K, K], in groups of `group_size` columns, each group's rounding given by
    `quantize_group` (see the module docstring).

    `act_order`: quantize the columns in descending order of the Gram matrix's diagonal (the
    inputs with the most energy first, while the most columns are left to absorb their error)
    instead of left to right. The groups stay the original runs of `group_size` columns, so the
    tensor type is unchanged; their parameters are chosen first, each from its columns of the
    weight as it is (a group's columns are no longer quantized together), and the codes are
    written back at the columns' own places."""
    n, k = weight.shape
    if gram.shape != (k, k):
        raise AOQError(f"{name}: Gram matrix of shape {tuple(gram.shape)} does not match weight {n}x{k}")
    w = weight.detach().float().clone()
    h = gram.detach().float().to(w.device).clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0  # an input that was always zero: its column cannot matter
    w[:, dead] = 0.0
    h.diagonal().add_(damping * torch.diag(h).mean())
    rounders, order = None, None
    if act_order:
        # Every group's rounding from the weight before any feedback, in group order (the
        # quantizers collect their parameters in the order they are called).
        rounders = [quantize_group(w[:, s:s + group_size].clone(), s) for s in range(0, k, group_size)]
        perm = torch.argsort(torch.diag(h), descending=True, stable=True)
        w, h = w[:, perm].contiguous(), h[perm][:, perm]
        order = perm.tolist()
    hinv = _upper_cholesky_of_inverse(h, name)

    codes = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    # One thread for the whole sweep: one column at a time is many tiny ops, which extra threads
    # only slow down (measured 20x slower on a busy 2-core machine), and switching the thread
    # count per group costs more again (14x the CPU time of a single-threaded sweep, measured on
    # a 1536 x 576 weight; the block updates are too small to gain from threads).
    with _single_thread():
        for start in range(0, k, group_size):
            end = min(start + group_size, k)
            block = w[:, start:end]  # updated by the feedback from the columns before it
            round_column = quantize_group(block, start) if order is None else None
            hb = hinv[start:end, start:end]
            errors = torch.empty_like(block)
            for i in range(end - start):
                col = start + i if order is None else order[start + i]  # the column's own place
                q, value = (round_column or rounders[col // group_size])(block[:, i])
                codes[:, col] = q.to(torch.uint8)
                err = (block[:, i] - value) / hb[i, i]
                block[:, i:] -= err[:, None] * hb[i, i:][None, :]
                errors[:, i] = err
            w[:, end:] -= errors @ hinv[start:end, end:]
    return codes


def gptq_quantize(weight: torch.Tensor, gram: torch.Tensor, config, *, damping: float = 0.01,
                  act_order: bool = False, name: str = "weight") -> AOQTensor:
    """`config.quantize_weight(weight)`'s tensor type, its values chosen by GPTQ on inputs whose
    Gram matrix is `gram`. `config` is one of GPTQ_CONFIGS; `act_order` as gptq_sweep takes it."""
    if isinstance(config, Int4WeightOnlyConfig):
        return _gptq_affine(weight, gram, config.group_size, QMIN, QMAX, config.symmetric, config.qparams,
                            lambda codes, scale, zero, block: Int4Tensor(
                                pack_int4(codes), scale, block, tuple(weight.shape), weight.dtype, zero=zero),
                            damping, act_order, name)
    if isinstance(config, IntxWeightOnlyConfig):
        bits = INT_DTYPES[config.weight_dtype]
        group = _intx_group(type(config).__name__, "granularity", config.granularity)
        return _gptq_affine(weight, gram, group or weight.shape[1], 0, (1 << bits) - 1,
                            config.mapping_type == "symmetric", "mse",
                            lambda codes, scale, zero, block: IntxTensor(
                                pack_intx(codes, bits), scale, bits, block, tuple(weight.shape), weight.dtype, zero=zero),
                            damping, act_order, name)
    if isinstance(config, Int4DQWeightOnlyConfig):
        return _gptq_grid(weight, gram, config.group_size, 4, damping, act_order, name)
    if isinstance(config, IntxDQWeightOnlyConfig):
        return _gptq_grid(weight, gram, config.group_size, config.bits, damping, act_order, name)
    names = ", ".join(c.__name__ for c in GPTQ_CONFIGS)
    raise AOQError(f"{name}: GPTQ calibrates {names}; got {type(config).__name__}")


def _check_weight(weight: torch.Tensor, name: str) -> None:
    if weight.ndim != 2 or not weight.is_floating_point():
        raise AOQError(f"{name}: GPTQ quantizes 2-D float weights, got {weight.dtype} {tuple(weight.shape)}")


def _gptq_affine(weight, gram, group_size, qmin, qmax, symmetric, qparams, build, damping, act_order, name):
    """Int4Tensor / IntxTensor: w = (q - mid) * scale + zero per group (core.primitives)."""
    _check_weight(weight, name)
    mid = midpoint(qmin, qmax)
    scales, zeros = [], []

    def quantize_group(block, start):
        scale, zero = choose_qparams_affine(block, (1, block.shape[1]), qmin, qmax, symmetric=symmetric,
                                            param_dtype=weight.dtype, name=name, method=qparams)
        scales.append(scale)
        zeros.append(zero)
        s = scale.float()[:, 0]
        z = zero.float()[:, 0] if zero is not None else torch.zeros_like(s)

        def round_column(col):
            q = torch.round((col - z) / s).add_(mid).clamp_(qmin, qmax)
            return q, (q - mid) * s + z
        return round_column

    codes = gptq_sweep(weight, gram, group_size, quantize_group, damping=damping, act_order=act_order, name=name)
    zero = None if symmetric else torch.cat(zeros, dim=1)
    return check_built(build(codes, torch.cat(scales, dim=1), zero, (1, group_size)), weight, name)


def _gptq_grid(weight, gram, g, bits, damping, act_order, name):
    """Int4DQTensor (bits 4) and IntxDQTensor (2, 3): the row grids from the weight as it is,
    each group's indices on them by the types' search on the updated weights,
    w = (q - L / 2) * d + c with L = 2^bits - 1."""
    _check_weight(weight, name)
    top = (1 << bits) - 1
    if bits == 4 and (g not in int4dq.GROUP_SIZES or weight.shape[1] % 2):
        Int4DQTensor.from_float(weight, g, name=name)  # its own error for a bad group size or shape
    if bits != 4 and (g not in int4dq.GROUP_SIZES or bits not in intxdq.BITS):
        IntxDQTensor.from_float(weight, bits, g, name=name)
    ranges = int4dq._group_minmax if bits == 4 else intxdq.group_ranges
    d0, c0 = by_row_chunks(weight, lambda w: ranges(w, g, top))
    tparams = int4dq.tensor_params(d0, c0)
    rparams = int4dq._encode_row_params(d0.amin(1), d0.amax(1), c0.amin(1), c0.amax(1), tparams)
    dlo, dstep, clo, cstep = (t[:, None] for t in int4dq.decode_row_params(rparams, tparams).unbind(1))
    gparams = []

    def nearest_index(value, lo, step):
        safe = torch.where(step > 0, step, torch.ones_like(step))
        return torch.where(step > 0, torch.round((value - lo) / safe), torch.zeros_like(value)).clamp(0, 15)

    def quantize_group(block, start):
        bd, bc = ranges(block, g, top)
        x, mask = int4dq._padded_groups(block, g)
        a, b, _ = int4dq_search(x, mask, nearest_index(bd, dlo, dstep), nearest_index(bc, clo, cstep),
                                dlo, dstep, clo, cstep, block.shape[1], levels=top)
        gparams.append(a.to(torch.uint8) | (b.to(torch.uint8) << 4))
        d = (dlo + a.float() * dstep)[:, 0]
        c = (clo + b.float() * cstep)[:, 0]

        def round_column(col):
            q = group_codes(col, d, c, top)
            return q, (q - top / 2) * d + c
        return round_column

    codes = gptq_sweep(weight, gram, g, quantize_group, damping=damping, act_order=act_order, name=name)
    gparams = torch.cat(gparams, dim=1)
    if bits != 4:
        return intxdq.from_codes(codes, gparams, rparams, tparams, bits, g, weight, name)
    out = Int4DQTensor(pack_int4(codes), gparams, rparams, tparams, (1, g), tuple(weight.shape), weight.dtype)
    return check_built(out, weight, name)


@contextlib.contextmanager
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _upper_cholesky_of_inverse(h: torch.Tensor, name: str) -> torch.Tensor:
    for extra in (0.0, 0.1, 1.0):
        hh = h if extra == 0 else h + torch.eye(h.shape[0], device=h.device) * extra * torch.diag(h).mean()
        chol, info = torch.linalg.cholesky_ex(hh)
        if int(info) == 0:
            inv = torch.cholesky_inverse(chol)
            upper, info = torch.linalg.cholesky_ex(inv, upper=True)
            if int(info) == 0:
                return upper
    raise AOQError(f"{name}: the calibration inputs' Gram matrix is not positive definite even after damping")
