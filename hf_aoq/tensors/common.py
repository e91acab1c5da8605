"""Ops every quantized weight type shares: F.linear, F.embedding, the matmul family, slicing.

They route through `hf_aoq.kernels`, which picks the kernel; a tensor type only says how to
dequantize, transpose (when it can) and slice its own fields.
"""
from __future__ import annotations

import sys
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import return_and_correct_aliasing

from .. import kernels
from ..core.errors import AOQError
from ..core.tensor import AOQTensor

aten = torch.ops.aten

MATMUL_FUNCTIONS = (
    torch.matmul,
    torch.mm,
    torch.Tensor.matmul,
    torch.Tensor.mm,
    torch.Tensor.__matmul__,
)


def _linear(func, types, args, kwargs):
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if not isinstance(w, AOQTensor) or isinstance(x, AOQTensor) or isinstance(bias, AOQTensor):
        return _dequantized_call(func, args, kwargs)
    return kernels.linear(x, w, bias)


def _embedding(func, types, args, kwargs):
    names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
    bound = dict(zip(names, args), **kwargs)
    indices, w = bound["input"], bound["weight"]
    if bound.get("max_norm") is not None or bound.get("sparse"):
        raise AOQError(f"F.embedding with max_norm or sparse=True is not supported on a {type(w).__name__}")
    return kernels.embedding(indices, w, bound.get("padding_idx"))


def _matmul(func, types, args, kwargs):
    a, b = args[0], args[1]
    if isinstance(b, AOQTensor) and not isinstance(a, AOQTensor):
        w = b.as_linear_weight()
        if w is not None:
            return kernels.linear(a, w, None)
    return _dequantized_call(func, args, kwargs)


def _addmm(func, types, args, kwargs):
    bias, a, b = args[0], args[1], args[2]
    plain = kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1 and len(args) == 3
    if plain and isinstance(b, AOQTensor) and not isinstance(a, AOQTensor) and not isinstance(bias, AOQTensor):
        w = b.as_linear_weight()
        if w is not None:
            return kernels.linear(a, w, bias)
    return _dequantized_call(func, args, kwargs)


def _dequantized_call(func, args, kwargs):
    """Run `func` on dequantized operands: correct for any op, fast for none."""
    ref = next((a for a in args if isinstance(a, torch.Tensor) and not isinstance(a, AOQTensor)), None)

    def plain(t):
        if not isinstance(t, AOQTensor):
            return t
        return t.dequantize(ref.dtype if ref is not None and ref.is_floating_point() else None)

    with torch._C.DisableTorchFunctionSubclass():
        return func(*[plain(a) for a in args], **{k: plain(v) for k, v in kwargs.items()})


def _slice(func, types, args, kwargs):
    self = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    start = args[2] if len(args) > 2 else kwargs.get("start")
    end = args[3] if len(args) > 3 else kwargs.get("end")
    step = args[4] if len(args) > 4 else kwargs.get("step", 1)
    size = self.shape[dim]
    dim = dim % self.ndim
    start = 0 if start is None else (start + size if start < 0 else min(start, size))
    end = size if end is None or end == sys.maxsize else (end + size if end < 0 else min(end, size))
    if step != 1:
        raise AOQError(f"{type(self).__name__} supports slicing with step 1 only, got step {step}")
    if start == 0 and end == size:
        return return_and_correct_aliasing(func, args, kwargs, self.apply_to_tensors(aten.alias.default))
    return self.to_canonical().slice_fields(dim, start, end)


def check_weight(weight: torch.Tensor, name: str, *, ndims: tuple[int, ...] = (2,), shapes: str = "a 2-D") -> None:
    """A weight that `from_float` can take: a plain, non-empty float tensor of `ndims` dimensions
    (`shapes` says which in the error)."""
    if isinstance(weight, AOQTensor):
        raise AOQError(f"{name} is already quantized ({type(weight).__name__})")
    if not isinstance(weight, torch.Tensor) or weight.ndim not in ndims:
        raise AOQError(f"{name}: expected {shapes} weight, got shape {tuple(getattr(weight, 'shape', ()))}")
    if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise AOQError(f"{name}: expected a float32, bfloat16 or float16 weight, got {weight.dtype}")
    if weight.numel() == 0:
        raise AOQError(f"{name}: cannot quantize an empty weight of shape {tuple(weight.shape)}")


def check_built(tensor: "AOQTensor", weight: torch.Tensor, name: str) -> "AOQTensor":
    """`tensor`, just made from `weight` by `from_float`, if a loader would accept it and it
    dequantizes to finite values; otherwise an AOQError naming the weight, so that nothing is
    saved that cannot be loaded. The dequantization is checked only for a weight within a
    factor 4 of its dtype's maximum: below that, the guarded ranges of core.primitives keep it
    finite, and the check would cost a float32 copy of the weight."""
    try:
        type(tensor).check_fields(tensor.fields())
    except AOQError as e:
        raise AOQError(f"{name}: the {type(tensor).__name__} made from it would not load back ({e})") from None
    amax = float(weight.detach().abs().amax())
    near_limit = amax > torch.finfo(weight.dtype).max / 4
    # Scales, zeros and per-tensor floats (float8 codes are clamped to finite values).
    bad = [f for f, t in tensor.tensor_fields().items()
           if t.is_floating_point() and t.element_size() > 1 and not bool(torch.isfinite(t).all())]
    if near_limit and not bad and not bool(torch.isfinite(tensor.dequantize()).all()):
        bad = ["its dequantized values"]
    if bad:
        raise AOQError(
            f"{name}: values up to {amax:.4g} are too close to the limit of {weight.dtype} for a "
            f"{type(tensor).__name__}: {', '.join(bad)} would not be finite; scale the weight down or use another scheme"
        )
    return tensor


def check_layout(fields, type_name: str, blocks: str, block_ok) -> None:
    """The layout rules every block-grid type shares: a 2-D [N, K] shape (or 3-D [E, N, K]
    fused experts, each expert laid out as a 2-D weight, block (1, ...)) with no empty
    dimension, and a block size that `block_ok(block, shape)` accepts for the 2-D matrix
    (`blocks` says which, for the message). A loader refuses anything else, as no kernel could run it."""
    shape, block = tuple(fields["shape"]), fields["block_size"]
    if len(shape) not in (2, 3) or 0 in shape:
        raise AOQError(f"attribute 'shape': {type_name} is a non-empty 2-D [N, K] weight or 3-D [E, N, K] "
                       f"experts, got {shape}")
    lead = (1,) * (len(shape) - 2)
    if (type(block) is not tuple or not all(type(b) is int for b in block) or len(block) != len(shape)
            or block[:-2] != lead or not block_ok(block[-2:], shape[-2:])):
        want = f"{blocks}, after a leading 1 for the expert dimension" if lead else blocks
        raise AOQError(f"attribute 'block_size': {block!r}, expected {want} for shape {shape}")


class DevicePacked:
    """Mixin for types with device packings (`packing` attribute, None when canonical): the
    packing registered in `hf_aoq.kernels` is undone for saving and chosen again per device."""

    @classmethod
    def check_fields(cls, fields) -> None:
        super().check_fields(fields)
        if fields.get("packing") is not None:
            raise AOQError(f"attribute 'packing': {fields['packing']!r}; checkpoints hold the canonical layout only")

    def to_canonical(self):
        if self.packing is None:
            return self
        if len(self.shape) == 3:  # fused experts: each expert was packed as a 2-D weight
            from .experts import map_experts
            return map_experts(self, lambda e: e.to_canonical())
        return kernels.get_packing(self.packing).unpack(self)

    def place(self):
        """Packed for this device's best kernel, large CPU buffers on huge pages (BlockGridTensor)."""
        return kernels.fields_on_huge_pages(self._packed_for_device())

    def _packed_for_device(self):
        if len(self.shape) == 3:  # each expert packed as a linear's weight, then stacked
            from .experts import map_experts
            return map_experts(self.to_canonical(), lambda e: e._packed_for_device())
        canonical = self.to_canonical()
        packing = kernels.best_packing(canonical)
        if packing is None:
            return canonical
        return self if packing.name == self.packing else packing.pack(canonical)

    def _to_device(self, device: torch.device):
        moved = self.to_canonical().apply_to_tensors(lambda t: t.to(device))
        return moved.place() if self.packing is not None else moved


class BlockGridTensor(AOQTensor):
    """Base of the quantized weight types: codes `qdata` (`codes_per_byte` per byte along the
    last dim) and per-block `scale` (and `zero`) grids of shape (N / block[0], ceil(K / block[1])).

    It gives them F.linear, F.embedding, the matmul family and slicing; a `transposable` type
    (all fields plain 2-D grids) also gets `t()`, so that `x @ w.t()` runs on the fast kernels.
    Dynamic-activation types define `quantize_input(x2d) -> (codes, scale)`.
    """

    codes_per_byte: ClassVar[int] = 1
    transposable: ClassVar[bool] = False

    def place(self):
        """Large CPU buffers on transparent huge pages (kernels/hugepages.py); the types with
        device packings (DevicePacked) repack first."""
        return kernels.fields_on_huge_pages(self)

    def quantize_input(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} does not quantize activations")

    def simulate_input_quantization(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self, "act_quant", None) is None or x.numel() == 0:
            return x  # an empty batch has no scale to choose (a per-tensor amax would fail)
        codes, scale = self.quantize_input(x.reshape(-1, x.shape[-1]))
        return (codes.float() * scale).to(x.dtype).reshape(x.shape)

    def as_linear_weight(self) -> "BlockGridTensor | None":
        return self.t() if self.transposable and len(self.shape) == 2 else None

    def select_rows(self, rows: torch.Tensor) -> "BlockGridTensor":
        return select_grid_rows(self.to_canonical(), rows)

    def slice_fields(self, dim: int, start: int, end: int) -> "BlockGridTensor":
        return slice_grid(self, dim, start, end, self.codes_per_byte)


BlockGridTensor.implements_torch_function(F.linear)(_linear)
BlockGridTensor.implements_torch_function(F.embedding)(_embedding)
BlockGridTensor.implements_torch_function(*MATMUL_FUNCTIONS)(_matmul)
BlockGridTensor.implements_torch_function(torch.addmm, torch.Tensor.addmm)(_addmm)
BlockGridTensor.implements(aten.slice.Tensor)(_slice)


@BlockGridTensor.implements(aten.t.default, aten.transpose.int)
def _transpose(func, types, args, kwargs):
    self = args[0]
    if not self.transposable:
        raise NotImplementedError(f"{type(self).__name__} does not support the op {func}; dequantize() first")
    if func is aten.transpose.int and sorted(d % 2 for d in args[1:3]) != [0, 1]:
        raise AOQError(f"{type(self).__name__} can only swap its two dimensions")
    out = self.replace(
        qdata=self.qdata.t(),
        scale=self.scale.t(),
        block_size=tuple(reversed(self.block_size)),
        shape=tuple(reversed(self.shape)),
    )
    return return_and_correct_aliasing(func, args, kwargs, out)


# ---------------------------------------------------------------------- block-grid fields
# Int4, Int8 and Float8 all hold `qdata` (codes, maybe several per byte along the last dim)
# and per-block `scale` (and `zero`) grids of shape (N / block[0], ceil(K / block[1])). Slicing and
# row gathers are the same operation on all of them.

def _grid_names(t) -> list[str]:
    return [n for n in ("scale", "zero") if getattr(t, n, None) is not None]


def slice_grid(t, dim: int, start: int, end: int, codes_per_byte: int = 1):
    block = list(t.block_size)
    full = t.shape[dim]
    b = block[dim]
    changes = {}
    last = dim == t.ndim - 1
    if b == full:  # one block spans the dim: the grid is kept, the block shrinks
        block[dim] = end - start
    elif start % b or (end % b and not (last and end == full)):
        raise AOQError(
            f"{type(t).__name__}: slice [{start}:{end}] of dim {dim} must align with its block size {b}"
        )
    else:
        # A slice that ends at the end of the last dim keeps its partial final block.
        for n in _grid_names(t):
            changes[n] = getattr(t, n).narrow(dim, start // b, -(-(end - start) // b))
    per = codes_per_byte if dim == t.ndim - 1 else 1
    if start % per or end % per:
        raise AOQError(f"{type(t).__name__}: slice [{start}:{end}] of dim {dim} must be a multiple of {per}")
    changes["qdata"] = t.qdata.narrow(dim, start // per, (end - start) // per)
    if last and getattr(t, "input_scale", None) is not None:
        changes["input_scale"] = t.input_scale[start:end]
    shape = list(t.shape)
    shape[dim] = end - start
    return t.replace(shape=tuple(shape), block_size=tuple(block), **changes)


def select_grid_rows(t, rows: torch.Tensor):
    block = list(t.block_size)
    changes = {"qdata": t.qdata.index_select(0, rows)}
    if block[0] == t.shape[0]:
        block[0] = rows.numel()
    elif block[0] == 1:
        for n in _grid_names(t):
            changes[n] = getattr(t, n).index_select(0, rows)
    else:
        raise AOQError(f"{type(t).__name__}: row lookup needs a block of 1 row or all rows, not {block[0]}")
    return t.replace(shape=(rows.numel(), t.shape[1]), block_size=tuple(block), **changes)


SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_grid_fields(
    fields, qdata_dtypes: tuple[torch.dtype, ...], codes_per_byte: int = 1, *, partial_last_block: bool = False,
    qdata_last_dim: int | None = None,
) -> None:
    """Refuse canonical block-grid fields that contradict the attributes (a loader calls this,
    through `check_fields`, before building a tensor from a checkpoint). With
    `partial_last_block`, the last dim may end in a partial block (docs/format.md).
    `qdata_last_dim`, if given, is qdata's last dimension (bit streams that are not a whole
    number of codes per byte), instead of the last dimension over `codes_per_byte`."""
    shape, block, dtype = tuple(fields["shape"]), fields["block_size"], fields["dtype"]
    if not shape:
        raise AOQError("attribute 'shape': a quantized weight needs at least one dimension")
    if not dtype.is_floating_point or dtype.itemsize < 2:
        raise AOQError(f"attribute 'dtype': {dtype} is not a float dtype of 16 bits or more")
    if type(block) is not tuple or len(block) != len(shape):
        raise AOQError(f"attribute 'block_size': {block!r} does not match shape {shape}")
    grid = []
    for dim, (d, b) in enumerate(zip(shape, block)):
        if type(b) is not int or b <= 0 or (d % b and not (partial_last_block and dim == len(shape) - 1)):
            raise AOQError(f"attribute 'block_size': {block} does not tile shape {shape}")
        grid.append(-(-d // b))
    grid = tuple(grid)
    qdata = fields["qdata"]
    if qdata.dtype not in qdata_dtypes:
        raise AOQError(f"field 'qdata': dtype {qdata.dtype}, expected one of {qdata_dtypes}")
    if qdata_last_dim is None and shape[-1] % codes_per_byte:
        raise AOQError(f"attribute 'shape': last dimension of {shape} is not a multiple of {codes_per_byte}")
    expected = shape[:-1] + (shape[-1] // codes_per_byte if qdata_last_dim is None else qdata_last_dim,)
    if qdata.shape != expected:
        raise AOQError(f"field 'qdata': shape {tuple(qdata.shape)}, expected {expected} for shape {shape}")
    scale, zero = fields["scale"], fields.get("zero")
    for n, t in (("scale", scale), ("zero", zero)):
        if t is None:
            continue
        if t.dtype not in SCALE_DTYPES:
            raise AOQError(f"field {n!r}: dtype {t.dtype}, expected one of {SCALE_DTYPES}")
        if t.shape != grid:
            raise AOQError(f"field {n!r}: shape {tuple(t.shape)}, expected {grid} (one entry per block)")
    if zero is not None and zero.dtype != scale.dtype:
        raise AOQError(f"field 'zero': dtype {zero.dtype} differs from scale's {scale.dtype}")


# ---------------------------------------------------------------------- input scales
# Activation-aware scales s [K] that could not be folded into the previous layer (hf_aoq.awq):
# the codes hold W * s, the forward divides its input by s (kernels.linear, before any kernel),
# and dequantize() returns the stored weight with its columns divided by s.

def check_input_scale(fields) -> None:
    """An optional `input_scale`: float32 [K] for a 2-D weight, finite and positive."""
    s = fields.get("input_scale")
    if s is None:
        return
    shape = tuple(fields["shape"])
    if len(shape) != 2:
        raise AOQError(f"field 'input_scale': only 2-D weights take one, got shape {shape}")
    if s.dtype != torch.float32 or tuple(s.shape) != (shape[1],):
        raise AOQError(f"field 'input_scale': {s.dtype} {tuple(s.shape)}, expected torch.float32 ({shape[1]},) "
                       f"for shape {shape}")
    if s.device.type != "meta" and not bool((torch.isfinite(s) & (s > 0)).all()):
        raise AOQError("field 'input_scale': expected finite positive numbers")


def unscale_input_columns(w: torch.Tensor, input_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 `w` [N, K] with its columns divided by `input_scale` [K], cast to `dtype`."""
    return (w.float() / input_scale.to(w.device)).to(dtype).contiguous()


def with_input_scale(tensor: "AOQTensor", input_scale: torch.Tensor, *, name: str = "weight") -> "AOQTensor":
    """`tensor` (Int4Tensor or Int4DQTensor, quantized from W * s) with `input_scale` s attached."""
    if "input_scale" not in type(tensor).optional_tensor_data_names:
        raise AOQError(f"{name}: a {type(tensor).__name__} has no input_scale field (Int4Tensor and Int4DQTensor do)")
    out = tensor.replace(input_scale=input_scale.detach().to(torch.float32, copy=True).to(tensor.qdata.device))
    type(out).check_fields(out.to_canonical().fields())
    return out
