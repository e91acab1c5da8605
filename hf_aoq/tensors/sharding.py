"""Cutting a quantized weight into tensor-parallel shards and putting shards back together.

A shard of a quantized weight is a quantized weight of the shard: its codes and its scales are
cut at the same place. `field_cuts(t, dim)` says, for each tensor field, how a cut of logical
dimension `dim` cuts it: along which field dimension and how many logical elements one field
element covers (2 codes per byte, a group of g columns per scale), or not at all (a per-row
scale under a cut of the columns, a per-tensor float). Fused experts [E, N, K] follow the same
rules on their last two dimensions; a cut of dim 0 (expert parallelism: whole experts per rank)
cuts every field, each expert's own per-tensor parameters included. From it come

    check_cut(t, dim, start, end, name)   refuse a cut that splits a group (or a code byte)
    cat_fields(parts, dim)                the inverse of slicing: shards back into one weight

and the aten ops DTensor and transformers' tensor-parallel layers call on a local shard:
`view` / `view_as` to its own shape (DTensor.from_local, to_local), `split` / `chunk`, `cat`
(slicing and `narrow` are `aten.slice`, in tensors.common), and `aten.embedding`, which a
vocabulary-parallel embedding runs on its shard under DTensor (with the ids it does not hold
masked out; F.embedding outside DTensor is the torch-function table's). Slicing itself is each type's
`slice_fields`, which follows the same rules.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

from .. import kernels
from ..core.errors import AOQError
from .common import BlockGridTensor, _slice
from .fpx import FPxTensor
from .int4dq import Int4DQTensor

aten = torch.ops.aten

# {field: (field dim, logical elements per field element)}, or None for a field a cut keeps whole.
FieldCuts = dict[str, "tuple[int, int] | None"]


def _block_grid_cuts(t: BlockGridTensor, dim: int) -> FieldCuts:
    cuts: FieldCuts = {"qdata": (dim, t.codes_per_byte if dim == t.ndim - 1 else 1)}
    b = t.block_size[dim]
    for n in ("scale", "zero"):
        if getattr(t, n, None) is not None:
            # One block spanning the dimension (a per-row scale under a cut of the columns, a
            # per-tensor scale) is kept whole by every shard.
            cuts[n] = None if b == t.shape[dim] else (dim, b)
    return cuts


def _int4dq_cuts(t: Int4DQTensor, dim: int) -> FieldCuts:
    rows, cols = t.ndim - 2, t.ndim - 1
    if dim < rows:  # the experts of a 3-D tensor, each with its own per-tensor parameters
        return {"qdata": (dim, 1), "gparams": (dim, 1), "rparams": (dim, 1), "tparams": (dim, 1)}
    if dim == rows:
        return {"qdata": (dim, 1), "gparams": (dim, 1), "rparams": (dim, 1), "tparams": None}
    return {"qdata": (cols, 2), "gparams": (cols, t.group_size), "rparams": None, "tparams": None}


def _fpx_cuts(t: FPxTensor, dim: int) -> FieldCuts:
    cuts = _block_grid_cuts(t, dim)
    if dim == t.ndim - 1:  # a row's b-bit codes are one bit stream: whole bytes hold 8 / gcd(b, 8) of them
        cuts["qdata"] = (dim, 8 // math.gcd(t.bits, 8))
    return cuts


# Looked up along the MRO; a tensor type whose fields are not plain block grids adds its rule here.
CUT_RULES: dict[type, Callable[..., FieldCuts]] = {BlockGridTensor: _block_grid_cuts, Int4DQTensor: _int4dq_cuts,
                                                   FPxTensor: _fpx_cuts}


def field_cuts(t: BlockGridTensor, dim: int) -> FieldCuts:
    """How a cut of logical dimension `dim` of canonical `t` cuts each of its tensor fields."""
    dim = dim % t.ndim
    for klass in type(t).__mro__:
        rule = CUT_RULES.get(klass)
        if rule is not None:
            return rule(t, dim)
    raise AOQError(f"{type(t).__name__} cannot be sharded")


def _group_word(field: str, per: int, t) -> str:
    if field == "qdata":
        return f"a byte of {per} codes" if per <= 2 else f"the bytes {per} codes share"
    return f"a group of {per} (group size {per})"


def check_cut(t: BlockGridTensor, dim: int, start: int, end: int, name: str = "weight",
              shape: tuple[int, ...] | None = None) -> None:
    """Raise AOQError, naming `name`, unless [start:end] of dim `dim` keeps `t`'s groups whole:
    every cut field must start on a group and end on one, or at the end of the dimension.
    `shape` is the whole weight's when `t` is a probe with its layout (fewer rows)."""
    dim = dim % t.ndim
    shape = tuple(t.shape) if shape is None else tuple(shape)
    full = shape[dim]
    cuts = [(cut[1], field) for field, cut in field_cuts(t, dim).items()
            if cut is not None and getattr(t, field, None) is not None]
    for per, field in sorted(cuts, reverse=True):  # the coarsest first: name the group, not the byte
        if start % per or (end % per and end != full):
            raise AOQError(
                f"{name}: the tensor-parallel plan gives this rank [{start}:{end}] of dim {dim} of its "
                f"{type(t).__name__} of shape {shape}, which cuts {_group_word(field, per, t)}; "
                f"each shard must hold whole groups: use a group size that divides {end - start}, another "
                f"number of ranks, or leave {name} unquantized"
            )


def cat_fields(parts: list[BlockGridTensor], dim: int) -> BlockGridTensor:
    """Shards of one weight (canonical, in order along `dim`) put back together: fields a cut
    splits are concatenated, fields it keeps whole must be equal in every part."""
    if not parts:
        raise AOQError("cat of no quantized tensors")
    parts = [p.to_canonical() for p in parts]
    first = parts[0]
    dim = dim % first.ndim
    for p in parts[1:]:
        same = {k: v for k, v in p.attributes().items() if k not in ("shape", "block_size")}
        want = {k: v for k, v in first.attributes().items() if k not in ("shape", "block_size")}
        if type(p) is not type(first) or same != want or p.ndim != first.ndim:
            raise AOQError(f"cat of quantized tensors needs one type and the same attributes; got {first!r} and {p!r}")
        if any(p.block_size[d] != first.block_size[d] for d in range(first.ndim) if d != dim):
            raise AOQError(f"cat along dim {dim}: blocks {first.block_size} and {p.block_size} differ elsewhere")
        if any(p.shape[d] != first.shape[d] for d in range(first.ndim) if d != dim):
            raise AOQError(f"cat along dim {dim}: shapes {tuple(first.shape)} and {tuple(p.shape)} differ elsewhere")
    total = sum(p.shape[dim] for p in parts)
    cuts = [field_cuts(p, dim) for p in parts]
    block = list(first.block_size)
    changes = {}
    for field in cuts[0]:
        values = [getattr(p, field) for p in parts]
        if all(v is None for v in values):
            continue
        kept = [c[field] is None for c in cuts]
        if all(kept):
            if not all(v.shape == values[0].shape and torch.equal(v, values[0]) for v in values[1:]):
                raise AOQError(f"cat along dim {dim}: field {field!r} differs between the parts, so they are not "
                               f"shards of one {type(first).__name__}")
            if field in ("scale", "zero"):
                block[dim] = total  # one block still spans the dimension
            continue
        if any(kept) or len({c[field] for c in cuts}) != 1:
            raise AOQError(f"cat along dim {dim}: the parts' blocks differ ({[p.block_size for p in parts]})")
        field_dim, per = cuts[0][field]
        for p in parts[:-1]:
            if p.shape[dim] % per:
                raise AOQError(f"cat along dim {dim}: a part of {p.shape[dim]} does not end on a group of {per}")
        changes[field] = torch.cat(values, dim=field_dim)
    shape = list(first.shape)
    shape[dim] = total
    fields = {**first.fields(), **changes, "shape": tuple(shape), "block_size": tuple(block)}
    type(first).check_fields(fields)
    return type(first)(**fields)


# ---------------------------------------------------------------------- aten ops
def _same_shape(self, size) -> bool:
    size = list(size)
    if size.count(-1) == 1 and self.numel():
        rest = 1
        for s in size:
            rest *= s if s != -1 else 1
        size[size.index(-1)] = self.numel() // rest if rest else 0
    return tuple(size) == tuple(self.shape)


@BlockGridTensor.implements(aten.view.default, aten._unsafe_view.default)
def _view(func, types, args, kwargs):
    """A view to its own shape (DTensor.from_local and to_local make one); nothing else, as a
    quantized weight's fields cannot follow an arbitrary reshape."""
    self, size = args[0], args[1]
    if not _same_shape(self, size):
        raise AOQError(f"{type(self).__name__} of shape {tuple(self.shape)} cannot be viewed as {tuple(size)}; "
                       f"dequantize() first")
    return return_and_correct_aliasing(func, args, kwargs, self.apply_to_tensors(aten.alias.default))


@BlockGridTensor.implements(aten.split.Tensor, aten.split_with_sizes.default)
def _split(func, types, args, kwargs):
    self = args[0]
    sizes = args[1] if len(args) > 1 else kwargs.get("split_size", kwargs.get("split_sizes"))
    dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % self.ndim
    full = self.shape[dim]
    if isinstance(sizes, int):
        sizes = [min(sizes, full - s) for s in range(0, full, sizes)] if sizes > 0 else []
    if sum(sizes) != full:
        raise AOQError(f"split sizes {list(sizes)} do not add up to dim {dim} of size {full}")
    out, start = [], 0
    for size in sizes:
        out.append(_slice(aten.slice.Tensor, types, (self, dim, start, start + size), {}))
        start += size
    return out


@BlockGridTensor.implements(aten.cat.default)
def _cat(func, types, args, kwargs):
    tensors = list(args[0])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not all(isinstance(t, BlockGridTensor) for t in tensors):
        raise AOQError("cat of a quantized tensor with a plain one; dequantize() first")
    return cat_fields(tensors, dim)


@BlockGridTensor.implements(aten.embedding.default)
def _embedding(func, types, args, kwargs):
    weight, indices = args[0], args[1]
    padding_idx = args[2] if len(args) > 2 else kwargs.get("padding_idx", -1)
    return kernels.embedding(indices, weight, None if padding_idx is None or padding_idx < 0 else padding_idx)
