"""Fused MoE experts: a 3-D [E, N, K] weight as one quantized tensor, and the ops MoE layers run on it.

A 3-D tensor of any block-grid type holds E experts, each quantized by the type's 2-D rule;
every tensor field gains a leading expert dimension (docs/format.md "Fused experts") and
`block_size` a leading 1. `quantize_experts` builds one from a float weight, `expert` views one
expert as the type's 2-D tensor, and `map_experts` applies a 2-D function (a device packing, its
undoing) to each expert and stacks the results back into one tensor.

The ops, as transformers 5's MoE forwards use them (integrations/moe.py, modeling_mixtral.py,
modeling_gpt_oss.py):
  - `w[e]` (aten.select) is expert e, `w[ids]` (aten.index) the experts `ids` gathered into a
    3-D tensor; `F.linear(x, w[e])` then runs the fast 2-D kernels (the "eager" forward);
  - `w.transpose(-2, -1)` is a `TransposedExperts` view, which `torch._grouped_mm` /
    `F.grouped_mm` (the "grouped_mm" forward) and `torch.bmm` take, and `w.mT[ids]` gathers
    into another (gpt-oss's "batched_mm" forward, when its parameter is such a view: a
    checkpoint's `stored_transposed` experts, hf_aoq.integrations.transformers.transposed, or
    experts the planner quantized transposed, hf_aoq.quantize.stored_in_by_out), and `w.mT[e]`
    the 2-D view of expert e, with which `x @ w.mT[e]` is `F.linear(x, w[e])` (gpt-oss's eager
    forward);
  - `torch.bmm(w[ids], x)` (the "batched_mm" forward) and `torch._grouped_mm(x, w, offs)` with w
    stored [E, K, N] (gpt-oss) run expert by expert.
Expert by expert means one `kernels.linear` per expert that got tokens (an expert with none is
skipped), so the kernel table picks the CPU kernels for packed experts and the reference
(dequantize, then the float op) elsewhere; any other op sees the dequantized weight. Under
torch.compile, grouped_mm's group ends are data, so its expert loop runs inside one opaque op
(`_grouped_mm_op`): the same kernels on the same rows as eager mode. bmm and the 3-D grouped_mm
loop over a static count of batch elements, each on its own rows, and trace as they are.
"""
from __future__ import annotations

import json
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import return_and_correct_aliasing

from .. import kernels
from ..core.errors import AOQError
from ..core.registry import enum_value, tensor_type
from ..core.tensor import AOQTensor
from .common import MATMUL_FUNCTIONS, BlockGridTensor, _dequantized_call

aten = torch.ops.aten


def is_experts(t) -> bool:
    with torch._C.DisableTorchFunctionSubclass():  # `t.shape` through __torch_function__ is slow
        return len(t.shape) == 3


# ---------------------------------------------------------------------- building and mapping
def quantize_experts(from_float, weight: torch.Tensor, name: str, **options) -> AOQTensor:
    """`from_float` (a type's 2-D constructor) applied to each expert of a float [E, N, K]
    weight, the results stacked into one 3-D tensor."""
    if isinstance(weight, AOQTensor):
        raise AOQError(f"{name} is already quantized ({type(weight).__name__})")
    if weight.ndim != 3 or weight.numel() == 0:
        raise AOQError(f"{name}: fused experts are a non-empty 3-D [E, N, K] weight, got shape {tuple(weight.shape)}")
    return stack_experts([from_float(weight[e], name=f"{name} (expert {e})", **options) for e in range(weight.shape[0])])


def stack_experts(parts: list[AOQTensor]) -> AOQTensor:
    """One 3-D tensor from 2-D tensors of one type, attributes and field shapes alike."""
    first = parts[0]
    names = list(first.tensor_fields())
    for i, p in enumerate(parts[1:], 1):
        if type(p) is not type(first) or p.attributes() != first.attributes() or list(p.tensor_fields()) != names:
            raise AOQError(f"expert {i} ({p!r}) does not match expert 0 ({first!r}); experts must share one layout")
    fields = {n: torch.stack([p.tensor_fields()[n] for p in parts]) for n in names}
    return first.replace(**fields, shape=(len(parts), *first.shape), block_size=(1, *first.block_size))


def expert(t: AOQTensor, e: int) -> AOQTensor:
    """Expert e of a 3-D tensor, as the type's 2-D tensor (its fields are views)."""
    return t.replace(**{n: f[e] for n, f in t.tensor_fields().items()}, shape=tuple(t.shape[1:]),
                     block_size=tuple(t.block_size[1:]))


def map_experts(t: AOQTensor, fn) -> AOQTensor:
    """`fn` (2-D tensor -> 2-D tensor) applied to each expert of `t`, stacked back."""
    return stack_experts([fn(expert(t, e)) for e in range(t.shape[0])])


def dequantize_experts(t: AOQTensor, dtype: torch.dtype | None) -> torch.Tensor:
    return torch.stack([expert(t, e).dequantize(dtype) for e in range(t.shape[0])])


# ---------------------------------------------------------------------- indexing
@BlockGridTensor.implements(aten.select.int)
def _select(func, types, args, kwargs):
    self, dim, index = args[0], args[1], args[2]
    if not is_experts(self) or dim % 3 != 0:
        raise NotImplementedError(f"{type(self).__name__} supports select on the expert dimension of a 3-D weight only")
    e = index + self.shape[0] if index < 0 else index
    if not 0 <= e < self.shape[0]:
        raise IndexError(f"expert {index} is out of range for {self.shape[0]} experts")
    return return_and_correct_aliasing(func, args, kwargs, expert(self, e))


@BlockGridTensor.implements(aten.index.Tensor)
def _index(func, types, args, kwargs):
    self, indices = args[0], args[1]
    ids = indices[0] if len(indices) == 1 else None
    if not is_experts(self) or ids is None or ids.dtype not in (torch.int64, torch.int32) or ids.ndim != 1:
        return _dequantized_call(func, args, kwargs)  # any other indexing, on the float weight
    ids = ids.to(torch.int64)
    e = self.shape[0]
    # Under torch.compile the ids are data (a check here would break the graph); index_select
    # still refuses one out of range.
    if not torch.compiler.is_compiling() and ids.numel() and bool(((ids < -e) | (ids >= e)).any()):
        raise IndexError(f"expert index out of range for {e} experts")
    ids = torch.where(ids < 0, ids + e, ids)
    fields = {n: f.index_select(0, ids) for n, f in self.tensor_fields().items()}
    return self.replace(**fields, shape=(ids.numel(), *self.shape[1:]))


# ---------------------------------------------------------------------- the transposed view
class TransposedExperts(torch.Tensor):
    """`w.transpose(-2, -1)` of a 3-D quantized experts tensor `w` [E, N, K]: shape [E, K, N],
    which grouped_mm and bmm take as their right operand. Made per forward, or held as the
    parameter of a module whose stored tensor is its transpose (saving stores `experts`).
    Indexing one expert gives the 2-D view of that expert ([K, N] over its [N, K] tensor), and
    `x @ view` runs it as a linear (the fast kernels: gpt-oss's eager `x @ w[e]`). Any op but
    those (transposing back, gathering experts, the matmul) runs on the dequantized transpose."""

    experts: AOQTensor

    @staticmethod
    def __new__(cls, experts: AOQTensor):
        if len(experts.shape) not in (2, 3):
            raise AOQError(f"TransposedExperts views a 2-D or 3-D quantized tensor, got shape {tuple(experts.shape)}")
        *e, n, k = experts.shape
        self = torch.Tensor._make_wrapper_subclass(cls, (*e, k, n), dtype=experts.dtype, device=experts.device)
        self.experts = experts
        return self

    def __repr__(self):
        return f"TransposedExperts({self.experts!r})"

    def __tensor_flatten__(self):
        return ["experts"], None

    def _stable_hash_for_caching(self) -> str:
        """torch.compile's cache key: the view's, then the stored tensor's (AOQTensor's)."""
        return f"TransposedExperts({self.experts._stable_hash_for_caching()})"

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return TransposedExperts(inner["experts"])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = _OPS.get(func)
        if impl is not None:
            return impl(func, types, args, kwargs)
        self = args[0] if args else None
        ndim = len(self.experts.shape) if isinstance(self, TransposedExperts) else 0
        if func in _TRANSPOSES and ndim and _swaps_last_two(args, kwargs, ndim):
            return self.experts
        if ndim == 3 and func is torch.Tensor.__getitem__ and _expert_ids(args[1]):  # w.mT[ids] is w[ids].mT
            return TransposedExperts(self.experts[args[1]])
        if ndim == 3 and func is torch.Tensor.__getitem__ and _one_expert(args[1]):  # w.mT[e] is w[e].mT
            return TransposedExperts(self.experts[int(args[1])])
        if func in MATMUL_FUNCTIONS and len(args) == 2 and not kwargs and _plain_times_view(*args):
            return kernels.linear(args[0], args[1].experts, None)  # x @ w_e.T: a linear
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def plain(t):
            return t.experts.dequantize().transpose(-2, -1) if isinstance(t, TransposedExperts) else t

        if func in (aten.detach.default, aten.alias.default) or (
                func is aten.view.default and tuple(args[1]) == tuple(args[0].shape)):  # DTensor.from_local's
            return TransposedExperts(args[0].experts)
        if func is aten._to_copy.default:  # .to(dtype / device), e.g. Module.to: the view of the moved tensor
            return TransposedExperts(aten._to_copy.default(args[0].experts, **(kwargs or {})))
        return func(*[plain(a) for a in args], **{k: plain(v) for k, v in (kwargs or {}).items()})


def _plain_times_view(x, w) -> bool:
    """x @ w for a float x (one row or more) and the 2-D view of one expert."""
    return (isinstance(w, TransposedExperts) and len(w.experts.shape) == 2 and isinstance(x, torch.Tensor)
            and not isinstance(x, (AOQTensor, TransposedExperts)) and x.ndim >= 2 and x.is_floating_point())


def _expert_ids(index) -> bool:
    return isinstance(index, torch.Tensor) and index.ndim == 1 and index.dtype in (torch.int64, torch.int32)


def _one_expert(index) -> bool:
    return (type(index) is int or isinstance(index, torch.Tensor) and index.ndim == 0
            and index.dtype in (torch.int64, torch.int32))


_TRANSPOSES = (torch.transpose, torch.Tensor.transpose, torch.swapaxes, torch.Tensor.swapaxes)


def _swaps_last_two(args, kwargs, ndim: int) -> bool:
    dims = list(args[1:3]) + [kwargs[k] for k in ("dim0", "dim1", "axis0", "axis1") if k in kwargs]
    return len(dims) == 2 and sorted(d % ndim for d in dims) == [ndim - 2, ndim - 1]


def _transpose(func, types, args, kwargs):
    self = args[0]
    if isinstance(self, AOQTensor) and is_experts(self) and _swaps_last_two(args, kwargs, 3):
        return TransposedExperts(self)
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


BlockGridTensor.implements_torch_function(*_TRANSPOSES)(_transpose)


# ---------------------------------------------------------------------- expert by expert
def _experts_of(w) -> tuple[AOQTensor, bool] | None:
    """(the 3-D quantized tensor, whether the operand is its [E, K, N] transposed view), or None."""
    if isinstance(w, TransposedExperts):
        return w.experts, True
    if isinstance(w, AOQTensor) and is_experts(w):
        return w, False
    return None


def _times(x: torch.Tensor, w: AOQTensor, transposed: bool) -> torch.Tensor:
    """x @ w_e.T for a transposed view (a linear: the fast kernels), x @ w_e otherwise."""
    if transposed:
        return kernels.linear(x, w, None)
    return torch.matmul(x, w)  # w_e stored [K, N] (gpt-oss): hf_aoq's matmul, the reference for most types


def grouped_mm(x: torch.Tensor, w, offs: torch.Tensor | None, bias=None, out_dtype=None) -> torch.Tensor:
    """torch._grouped_mm with a quantized right operand: for a 2-D x [S, K], the rows of group e
    (offs[e - 1]:offs[e], int32 ends) times expert e, rows past offs[-1] zero; for a 3-D x
    [E, M, K], x[e] times expert e."""
    ws, transposed = _experts_of(w)
    n = w.shape[-1]
    if x.ndim == 3:
        if offs is not None:
            raise AOQError("grouped_mm: offs must be None for a 3-D left operand")
        out = torch.stack([_times(x[e], expert(ws, e), transposed) for e in range(ws.shape[0])]) if x.shape[0] \
            else x.new_zeros(0, x.shape[1], n)
    else:
        if offs is None or offs.ndim != 1 or offs.numel() != ws.shape[0]:
            raise AOQError(f"grouped_mm: offs must be a 1-D tensor of {ws.shape[0]} group ends, got "
                           f"{None if offs is None else tuple(offs.shape)}")
        if torch.compiler.is_compiling():
            # The group ends are data in a graph: the expert loop runs inside one opaque op.
            fields = ws.tensor_fields()
            description = _description(type(ws).__name__, tuple(fields), tuple(ws.attributes().items()))
            out = _grouped_mm_op(x, offs, list(fields.values()), description, transposed, bias)
            return out if out_dtype is None else out.to(out_dtype)
        out = _grouped_mm_rows(x, ws, transposed, offs, bias)
    if x.ndim == 3 and bias is not None:
        out = out + bias.unsqueeze(1)
    return out if out_dtype is None else out.to(out_dtype)


def _grouped_mm_rows(x: torch.Tensor, ws: AOQTensor, transposed: bool, offs: torch.Tensor, bias) -> torch.Tensor:
    """grouped_mm's 2-D case: each expert on the rows of its group, the empty ones skipped."""
    out = x.new_zeros(x.shape[0], ws.shape[1] if transposed else ws.shape[2])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:  # an expert that got no tokens costs nothing
            rows = _times(x[start:end], expert(ws, e), transposed)
            out[start:end] = rows if bias is None else rows + bias[e]
        start = max(start, end)
    return out


# ---------------------------------------------------------------------- grouped_mm in a graph
# torch.compile cannot slice by the group ends (data) without a graph break, so a compiled
# grouped_mm calls one custom op that receives the weight as its inner tensors and a
# description of its type and attributes, rebuilds it and runs `_grouped_mm_rows` (the eager
# loop, same kernels, same rows). The description is JSON in the checkpoint metadata's tagged
# attribute encoding (serialization/metadata.py), the type named through the allow-list of
# tensor types; `packing` (which checkpoints never hold) names a registered packing of that type.
@torch._dynamo.assume_constant_result
def _description(type_name: str, names: tuple[str, ...], attributes: tuple[tuple[str, object], ...]) -> str:
    """The op's description of a tensor of type `type_name` with tensor fields `names` (made
    while tracing, once per layout: constants in, a constant out)."""
    from ..serialization.metadata import encode_value

    encoded = {}
    for a, v in attributes:
        if v is None:
            continue
        encoded[a] = ["enum", _packing(type_name, v)] if a == "packing" else encode_value(
            tuple(v) if isinstance(v, torch.Size) else v, f"{type_name}.{a}")
    return json.dumps({"type": type_name, "fields": list(names), "attributes": encoded}, sort_keys=True)


def _packing(type_name: str, name) -> str:
    """`name` if it is a packing registered for `type_name` (or a base type of it)."""
    cls = tensor_type(type_name)
    try:
        packing = kernels.get_packing(name)
    except ValueError as e:
        raise AOQError(f"{type_name}.packing: {e}") from None
    if packing.type_name not in {c.__name__ for c in cls.__mro__}:
        raise AOQError(f"{type_name}.packing: {name!r} is a packing of {packing.type_name}")
    return name


_DECODED: dict[str, tuple[type, tuple[str, ...], dict]] = {}  # description -> (type, field names, attributes)


def _decoded(description: str) -> tuple[type, tuple[str, ...], dict]:
    """A description's (type, tensor field names, attribute values), decoded and checked once."""
    known = _DECODED.get(description)
    if known is not None:
        return known
    from ..serialization.common import load_json_object
    from ..serialization.metadata import decode_value

    what = "grouped_mm experts description"
    doc = load_json_object(description, "<grouped_mm>", what)
    if doc.keys() != {"type", "fields", "attributes"} or type(doc["fields"]) is not list \
            or type(doc["attributes"]) is not dict:
        raise AOQError(f"{what}: expected 'type', 'fields' (a list) and 'attributes' (an object), got {sorted(doc)}")
    cls = tensor_type(doc["type"])
    type_name = cls.__name__
    attributes = {a: decode_value(v) for a, v in doc["attributes"].items()}
    for a, v in attributes.items():
        if type(v) is str:
            attributes[a] = _packing(type_name, v) if a == "packing" else enum_value(f"{type_name}.{a}", v)
    names = tuple(doc["fields"])
    tensors = set(cls.tensor_data_names) | set(cls.optional_tensor_data_names)
    unknown = set(names) - tensors | attributes.keys() - set(cls.attribute_names())
    if unknown:
        raise AOQError(f"{what}: {type_name} has no tensor field or attribute {sorted(unknown)[0]!r}")
    missing = set(cls.tensor_data_names) - set(names) | set(cls.tensor_attribute_names) - attributes.keys()
    if missing or len(set(names)) != len(names):
        raise AOQError(f"{what}: {type_name} needs each of its tensor fields {sorted(tensors)} once and its "
                       f"attributes {sorted(cls.tensor_attribute_names)}; got fields {list(names)}, "
                       f"attributes {sorted(attributes)}")
    known = _DECODED[description] = (cls, names, attributes)
    return known


def _grouped_mm_out(x, offs, tensors, description, transposed, bias):
    shape = _decoded(description)[2]["shape"]
    return x.new_empty(x.shape[0], shape[1] if transposed else shape[2])


@kernels.opaque_op("grouped_mm_experts", _grouped_mm_out)
def _grouped_mm_op(x: torch.Tensor, offs: torch.Tensor, tensors: list[torch.Tensor], description: str,
                   transposed: bool, bias: Optional[torch.Tensor]) -> torch.Tensor:
    cls, names, attributes = _decoded(description)
    if len(tensors) != len(names):
        raise AOQError(f"grouped_mm_experts: {len(tensors)} tensors for the fields {list(names)}")
    ws = cls(**attributes, **dict(zip(names, tensors)))
    return _grouped_mm_rows(x, ws, transposed, offs, bias)


def _grouped_mm_fn(func, types, args, kwargs):
    names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
    bound = dict(zip(names, args), **kwargs)
    a, b = bound["mat_a"], bound["mat_b"]
    if _experts_of(b) is None or isinstance(a, (AOQTensor, TransposedExperts)):
        return _dequantized_call(func, args, kwargs)
    return grouped_mm(a, b, bound.get("offs"), bound.get("bias"), bound.get("out_dtype"))


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm with one quantized 3-D operand, batch element by batch element."""
    left = _experts_of(a)
    if left is not None:  # w [B, N, K] @ x [B, K, M]: (x.mT @ w.T).mT
        ws, transposed = left
        if b.shape[0] == 0:
            return b.new_zeros(0, a.shape[1], b.shape[2])
        if transposed:  # w.mT [B, K, N] @ x [B, N, M]
            return torch.stack([torch.matmul(b[i].mT, expert(ws, i)).mT for i in range(b.shape[0])])
        return torch.stack([kernels.linear(b[i].mT, expert(ws, i), None).mT for i in range(b.shape[0])])
    ws, transposed = _experts_of(b)
    if a.shape[0] == 0:
        return a.new_zeros(0, a.shape[1], b.shape[2])
    return torch.stack([_times(a[i], expert(ws, i), transposed) for i in range(a.shape[0])])


def _bmm_fn(func, types, args, kwargs):
    a, b = args[0], args[1]
    quantized = [_experts_of(t) is not None for t in (a, b)]
    if kwargs or sum(quantized) != 1 or any(isinstance(t, AOQTensor) and not is_experts(t) for t in (a, b)):
        return _dequantized_call(func, [_plain_view(t) for t in args], kwargs)
    return bmm(a, b)


def _plain_view(t):
    return t.experts.dequantize().transpose(-2, -1) if isinstance(t, TransposedExperts) else t


_GROUPED_MM = tuple(f for f in (getattr(torch, "_grouped_mm", None), getattr(F, "grouped_mm", None)) if f is not None)
_BMM = (torch.bmm, torch.Tensor.bmm)
_OPS = {**{f: _grouped_mm_fn for f in _GROUPED_MM}, **{f: _bmm_fn for f in _BMM}}
BlockGridTensor.implements_torch_function(*_GROUPED_MM)(_grouped_mm_fn)
BlockGridTensor.implements_torch_function(*_BMM)(_bmm_fn)
