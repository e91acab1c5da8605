"""AOQTensor: the base class of every quantized tensor, built from four declared field lists.

A tensor type declares

    tensor_data_names                 required tensors            (e.g. qdata, scale)
    tensor_attribute_names            required non-tensor values  (must include shape and dtype)
    optional_tensor_data_names        tensors that may be None
    optional_tensor_attribute_names   values that may be None

and the constructor takes them in exactly that order, every optional one defaulting to None, so
adding an optional field never breaks an old caller, an old pickle or an old checkpoint.
`shape` and `dtype` are the logical shape and dtype the tensor presents (and dequantizes to);
they live on the wrapper itself, every other field is an instance attribute.

From the declaration this class provides flatten/unflatten for torch.compile, repr, detach,
clone, alias, `copy_`, `.to(device)` / `.to(dtype)`, pickling with defaults for missing
optional fields, `torch.load(weights_only=True)` registration, and per-class op tables.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable, ClassVar, Mapping

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

from . import compile_cache
from .errors import AOQError

aten = torch.ops.aten

_WRAPPER_ATTRIBUTES = ("shape", "dtype")

# Every graph compiled in this process is keyed on hf_aoq's sources (Inductor's FX graph cache
# does not see its ops' schemas: compile_cache).
compile_cache.tag_compile_caches()

# More parts of torch.compile's cache key, added by the layers above (the kernel table adds what
# this machine's kernels allow): a graph traced where other kernels were chosen is not reused.
CACHE_KEY_PARTS: list[Callable[[], str]] = []

# The instance attribute where the kernel table remembers which kernel it chose for this tensor
# (kernels/registry.py `select_kernel`). It is no field: setting any attribute drops it (a choice
# may depend on every field), and pickling and deepcopy leave it out.
KERNEL_CACHE = "_aoq_kernel_choices"
# Where `__tensor_flatten__` keeps its answer: torch.compile's guards call it on every call of a
# compiled graph, twice per quantized weight (5 us each: 1.6 ms of a 22-layer decode step), and
# the answer changes only when a field is set (which drops it, as KERNEL_CACHE).
FLATTEN_CACHE = "_aoq_flattened"

# Every class's resolved op tables (op -> implementation found through the MRO, or None), emptied
# whenever an implementation is registered on any class (a base class's entry changes its
# subclasses' answers).
_RESOLVED: list[dict] = []
_NOT_RESOLVED = object()

OpImpl = Callable[[Any, tuple, tuple, dict], Any]


class AOQTensor(torch.Tensor):
    tensor_data_names: ClassVar[tuple[str, ...]] = ()
    tensor_attribute_names: ClassVar[tuple[str, ...]] = ()
    optional_tensor_data_names: ClassVar[tuple[str, ...]] = ()
    optional_tensor_attribute_names: ClassVar[tuple[str, ...]] = ()
    # Bumped for any change other than adding an optional field; see docs/format.md.
    schema_version: ClassVar[int] = 1
    # {v: upgrade} for every v < schema_version: `upgrade(record) -> record` turns the fields of a
    # schema-v checkpoint (name -> tensor or attribute value, as stored) into schema v+1 fields.
    schema_upgraders: ClassVar[Mapping[int, Callable[[dict[str, Any]], dict[str, Any]]]] = {}

    # Per-class op tables, filled by `implements` / `implements_torch_function`; each subclass
    # gets its own, and lookups walk the MRO so subclasses inherit and may override.
    _aten_table: ClassVar[dict] = {}
    _torch_fn_table: ClassVar[dict] = {}
    _resolved: ClassVar[dict[str, dict]] = {"_aten_table": {}, "_torch_fn_table": {}}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._aten_table = {}
        cls._torch_fn_table = {}
        cls._resolved = {"_aten_table": {}, "_torch_fn_table": {}}
        _RESOLVED.extend(cls._resolved.values())
        if not cls.tensor_data_names:
            return  # an abstract intermediate class
        names = cls.field_names()
        if len(set(names)) != len(names):
            raise TypeError(f"{cls.__name__}: a field name is declared twice in {names}")
        missing = [n for n in _WRAPPER_ATTRIBUTES if n not in cls.tensor_attribute_names]
        if missing:
            raise TypeError(f"{cls.__name__}: tensor_attribute_names must include {missing}")
        version = cls.schema_version
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise TypeError(f"{cls.__name__}: schema_version must be an int >= 1, got {version!r}")
        # Old checkpoints must keep loading: every older schema needs its upgrader.
        no_upgrader = [v for v in range(1, version) if not callable(cls.schema_upgraders.get(v))]
        if no_upgrader:
            raise TypeError(f"{cls.__name__}: schema_version {version} needs schema_upgraders for {no_upgrader}")
        for n in names:
            # A field that shadows a Tensor attribute would be unreadable and would fool
            # hasattr-based checks when unpickling; refuse it at class creation.
            if n not in _WRAPPER_ATTRIBUTES and hasattr(torch.Tensor, n):
                raise TypeError(f"{cls.__name__}: field name {n!r} shadows a torch.Tensor attribute")
        torch.serialization.add_safe_globals([cls])

    # ------------------------------------------------------------------ declared fields
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """All field names in constructor order."""
        return (
            tuple(cls.tensor_data_names)
            + tuple(cls.tensor_attribute_names)
            + tuple(cls.optional_tensor_data_names)
            + tuple(cls.optional_tensor_attribute_names)
        )

    @classmethod
    def attribute_names(cls) -> tuple[str, ...]:
        return tuple(cls.tensor_attribute_names) + tuple(cls.optional_tensor_attribute_names)

    @classmethod
    def _bind(cls, args: tuple, kwargs: dict) -> dict[str, Any]:
        names = cls.field_names()
        if len(args) > len(names):
            raise TypeError(f"{cls.__name__} takes at most {len(names)} fields, got {len(args)} positional")
        fields = dict(zip(names, args))
        for k, v in kwargs.items():
            if k not in names:
                raise TypeError(f"{cls.__name__} has no field {k!r}; fields are {names}")
            if k in fields:
                raise TypeError(f"{cls.__name__}: field {k!r} given twice")
            fields[k] = v
        required = tuple(cls.tensor_data_names) + tuple(cls.tensor_attribute_names)
        absent = [n for n in required if fields.get(n) is None]
        if absent:
            raise TypeError(f"{cls.__name__}: missing required field(s) {absent}")
        for n in cls.optional_tensor_data_names + cls.optional_tensor_attribute_names:
            fields.setdefault(n, None)
        for n in tuple(cls.tensor_data_names) + tuple(cls.optional_tensor_data_names):
            v = fields[n]
            if v is not None and not isinstance(v, torch.Tensor):
                raise TypeError(f"{cls.__name__}: field {n!r} must be a tensor, got {type(v).__name__}")
        for n in cls.attribute_names():
            if isinstance(fields[n], torch.Tensor) and n != "shape":
                raise TypeError(f"{cls.__name__}: attribute {n!r} must not be a tensor")
        if not isinstance(fields["dtype"], torch.dtype):
            raise TypeError(f"{cls.__name__}: dtype must be a torch.dtype, got {fields['dtype']!r}")
        fields["shape"] = torch.Size(fields["shape"])
        return fields

    def __new__(cls, *args, **kwargs):
        return cls._wrap(cls._bind(args, kwargs))

    @classmethod
    def _wrap(cls, fields: Mapping[str, Any]) -> "AOQTensor":
        first = fields[cls.tensor_data_names[0]]
        self = torch.Tensor._make_wrapper_subclass(
            cls, fields["shape"], dtype=fields["dtype"], device=first.device, requires_grad=False
        )
        # Straight into the instance dict: no __setattr__ per field (this runs on every replace()).
        self.__dict__.update((name, value) for name, value in fields.items() if name not in _WRAPPER_ATTRIBUTES)
        return self

    @classmethod
    def from_checked_fields(cls, fields: Mapping[str, Any]) -> "AOQTensor":
        """Build from every declared field by name (None where absent) once `check_fields` and
        the caller have checked them: a loader's fast path past the constructor's own checks.
        A type that overrides `__new__` or `_bind` is built through its constructor."""
        if cls.__new__ is not AOQTensor.__new__ or cls._bind.__func__ is not AOQTensor._bind.__func__:
            return cls(**fields)
        return cls._wrap(fields)

    def __init__(self, *args, **kwargs):
        # Everything happens in __new__; Tensor.__init__ must not see the fields.
        pass

    def __setattr__(self, name, value):
        # A field set after construction may change which kernel applies and what
        # __tensor_flatten__ gives: forget both.
        self.__dict__.pop(KERNEL_CACHE, None)
        self.__dict__.pop(FLATTEN_CACHE, None)
        super().__setattr__(name, value)

    def _clear_non_serializable_cached_data(self):
        # torch's hook, called before pickling and deepcopy: the kernel choices hold functions, and
        # the flattened form is remade from the fields.
        self.__dict__.pop(KERNEL_CACHE, None)
        self.__dict__.pop(FLATTEN_CACHE, None)
        super()._clear_non_serializable_cached_data()

    @classmethod
    def check_fields(cls, fields: Mapping[str, Any]) -> None:
        """Raise AOQError if canonical-layout `fields` (every declared name, None where absent)
        contradict each other; a loader calls this before building a tensor from a file.
        Types extend it with their own dtype and shape rules; messages name the field."""
        shape = fields.get("shape")
        if not isinstance(shape, (tuple, list)) or any(type(d) is not int or d < 0 for d in shape):
            raise AOQError(f"attribute 'shape': expected a list of non-negative ints, got {shape!r}")
        if not isinstance(fields.get("dtype"), torch.dtype):
            raise AOQError(f"attribute 'dtype': expected a torch.dtype, got {fields.get('dtype')!r}")

    def fields(self) -> dict[str, Any]:
        """Every declared field by name, in constructor order."""
        return {n: getattr(self, n) for n in self.field_names()}

    def tensor_fields(self) -> dict[str, torch.Tensor]:
        """The tensor fields that are present (optional ones that are None are left out)."""
        names = tuple(self.tensor_data_names) + tuple(self.optional_tensor_data_names)
        return {n: t for n in names if (t := getattr(self, n)) is not None}

    def attributes(self) -> dict[str, Any]:
        return {n: getattr(self, n) for n in self.attribute_names()}

    def replace(self, **changes) -> "AOQTensor":
        """A new tensor of the same type with some fields replaced."""
        fields = self.fields()
        fields.update(changes)
        return type(self)(**fields)

    def apply_to_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "AOQTensor":
        """A new tensor of the same type with `fn` applied to every present tensor field."""
        return self.replace(**{n: fn(t) for n, t in self.tensor_fields().items()})

    # ------------------------------------------------------------------ torch.compile
    def __tensor_flatten__(self):
        # The context is (name, value) pairs so that unflatten never depends on position.
        known = self.__dict__.get(FLATTEN_CACHE)
        if known is None:
            ctx = tuple((n, getattr(self, n)) for n in self.attribute_names())
            known = self.__dict__[FLATTEN_CACHE] = (tuple(self.tensor_fields()), ctx)
        return list(known[0]), known[1]

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, ctx, outer_size, outer_stride):
        fields = dict(ctx)
        fields.update(inner_tensors)
        if outer_size is not None:
            fields["shape"] = outer_size
        return cls(**fields)

    def _stable_hash_for_caching(self) -> str:
        """This tensor's part of torch.compile's on-disk cache key (AOT autograd's cache).

        The graph torch caches is traced through hf_aoq's kernels, which the key would otherwise
        not see: a graph compiled by another hf_aoq (different kernels, different op arguments)
        would be reused as is. So the key holds a digest of hf_aoq's own sources, besides the
        type, the attributes and each field tensor's metadata (never its values)."""
        parts = [type(self).__qualname__, compile_cache.package_source_digest(), repr(tuple(self.shape)),
                 str(self.dtype), str(self.requires_grad)]
        parts += [part() for part in CACHE_KEY_PARTS]
        for n in self.attribute_names():
            if n not in _WRAPPER_ATTRIBUTES:
                parts.append(f"{n}={getattr(self, n)!r}")
        for n, t in self.tensor_fields().items():
            parts.append(f"{n}:{t.dtype}:{tuple(t.shape)}:{t.stride()}:{t.storage_offset()}:{t.device.type}")
        return hashlib.blake2b("\0".join(parts).encode(), digest_size=16).hexdigest()

    # ------------------------------------------------------------------ pickling
    def __setstate__(self, state):
        torch._utils._set_obj_state(self, state)
        # Test the instance dict, not hasattr: a class-level or Tensor attribute of the same
        # name would make hasattr true and leave the field unset.
        for n in tuple(self.optional_tensor_data_names) + tuple(self.optional_tensor_attribute_names):
            if n not in self.__dict__:
                setattr(self, n, None)
        absent = [n for n in self.tensor_data_names if n not in self.__dict__]
        absent += [n for n in self.tensor_attribute_names if n not in _WRAPPER_ATTRIBUTES and n not in self.__dict__]
        if absent:
            raise AOQError(f"cannot unpickle {type(self).__name__}: required field(s) {absent} missing")

    def __repr__(self):
        parts = []
        for n, v in self.fields().items():
            if isinstance(v, torch.Tensor):
                v = f"<{str(v.dtype).removeprefix('torch.')} {list(v.shape)}>"
            elif n == "shape":
                v = list(v)
            parts.append(f"{n}={v}")
        return f"{type(self).__name__}({', '.join(parts)})"

    # ------------------------------------------------------------------ placement hooks
    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__}.dequantize")

    def simulate_input_quantization(self, x: torch.Tensor) -> torch.Tensor:
        """What the kernels do to the activation before the matmul, done in float (identity
        for weight-only types). The reference kernel uses it."""
        return x

    def as_linear_weight(self) -> "AOQTensor | None":
        """The weight W with `linear(x, W) == x @ self`, if this type can transpose; else None."""
        return None

    def select_rows(self, rows: torch.Tensor) -> "AOQTensor":
        raise NotImplementedError(f"{type(self).__name__} does not support row lookups")

    def slice_fields(self, dim: int, start: int, end: int) -> "AOQTensor":
        raise NotImplementedError(f"{type(self).__name__} does not support slicing")

    def to_canonical(self) -> "AOQTensor":
        """The portable layout that is saved; types with device packings override this."""
        return self

    def place(self) -> "AOQTensor":
        """Repack for the fastest kernel on this tensor's device (no-op by default)."""
        return self

    def _to_device(self, device: torch.device) -> "AOQTensor":
        return self.apply_to_tensors(lambda t: t.to(device))

    def _to_dtype(self, dtype: torch.dtype) -> "AOQTensor":
        """Change the logical dtype; scales keep their own precision."""
        if not dtype.is_floating_point:
            raise AOQError(
                f"{type(self).__name__} can present only a floating dtype; .to({dtype}) is not supported "
                f"(call .dequantize() first for a plain tensor)"
            )
        return self.replace(dtype=dtype)

    # ------------------------------------------------------------------ op tables
    @classmethod
    def implements(cls, *ops) -> Callable[[OpImpl], OpImpl]:
        """Register `fn(func, types, args, kwargs)` for aten ops on this class and its subclasses."""

        def register(fn):
            for op in ops:
                cls._aten_table[op] = fn
            _forget_resolved()
            return fn

        return register

    @classmethod
    def implements_torch_function(cls, *fns) -> Callable[[OpImpl], OpImpl]:
        """Register `fn(func, types, args, kwargs)` for torch-level functions such as F.linear."""

        def register(fn):
            for f in fns:
                cls._torch_fn_table[f] = fn
            _forget_resolved()
            return fn

        return register

    @classmethod
    def _lookup(cls, table: str, op) -> OpImpl | None:
        """The implementation of `op` in `table` ("_aten_table" or "_torch_fn_table") through the
        MRO, resolved once per class and op (every call of F.linear asks)."""
        resolved = cls._resolved[table]
        try:
            impl = resolved.get(op, _NOT_RESOLVED)
        except TypeError:  # an unhashable callable
            return cls._walk_mro(table, op)
        if impl is _NOT_RESOLVED:
            impl = resolved[op] = cls._walk_mro(table, op)
        return impl

    @classmethod
    def _walk_mro(cls, table: str, op) -> OpImpl | None:
        for klass in cls.__mro__:
            impl = klass.__dict__.get(table, {}).get(op)
            if impl is not None:
                return impl
        return None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        impl = cls._lookup("_torch_fn_table", func)
        if impl is not None:
            return impl(func, types, args, kwargs or {})
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = cls._lookup("_aten_table", func)
        if impl is None:
            raise NotImplementedError(
                f"{cls.__name__} does not support the op {func}; dequantize() first, "
                f"or add it to {cls.__name__}'s op table"
            )
        return impl(func, types, args, kwargs)


_RESOLVED.extend(AOQTensor._resolved.values())


def _forget_resolved() -> None:
    for resolved in _RESOLVED:
        resolved.clear()


# ---------------------------------------------------------------------- shared ops
@AOQTensor.implements(aten.detach.default, aten.alias.default)
def _view_like(func, types, args, kwargs):
    self = args[0]
    return return_and_correct_aliasing(func, args, kwargs, self.apply_to_tensors(func))


@AOQTensor.implements(aten.clone.default)
def _clone(func, types, args, kwargs):
    self = args[0]
    return return_and_correct_aliasing(func, args, kwargs, self.apply_to_tensors(torch.clone))


@AOQTensor.implements(aten._to_copy.default)
def _to_copy(func, types, args, kwargs):
    self = args[0]
    out = self
    device = kwargs.get("device")
    dtype = kwargs.get("dtype")
    if device is not None and not same_device(device, self.device):
        out = out._to_device(torch.device(device))
    if dtype is not None and dtype != self.dtype:
        out = out._to_dtype(dtype)
    if out is self:
        out = self.apply_to_tensors(torch.clone)
    return out


def same_device(a, b) -> bool:
    """Whether two devices are one: `torch.device("cuda")` is the current CUDA device, which
    compares unequal to `cuda:0` (so `.to("cuda")` would repack a weight already there)."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.index == b.index:
        return True
    current = torch.cuda.current_device() if a.type == "cuda" else None
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def _metadata(t: AOQTensor) -> tuple:
    return (
        type(t),
        tuple(t.attributes().items()),
        tuple((n, x.shape, x.dtype) for n, x in t.tensor_fields().items()),
    )


@AOQTensor.implements(aten.copy_.default)
def _copy_(func, types, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(src, AOQTensor) or type(src) is not type(dst):
        raise AOQError(f"copy_ into {dst!r} needs a source of the same type; got {src!r}")
    if src.device != dst.device or _metadata(src) != _metadata(dst):
        # Bring src into dst's layout (never unpack dst): canonical on dst's device, then
        # packed the way placement packs there if dst is packed.
        src = src.to_canonical()._to_device(dst.device)
        if _metadata(src) != _metadata(dst):
            src = src.place()
        if _metadata(src) != _metadata(dst):
            raise AOQError(
                f"copy_ into {dst!r} needs a source of the same type, attributes and field shapes; got {src!r}"
            )
    for n, t in dst.tensor_fields().items():
        t.copy_(getattr(src, n))
    return dst


@AOQTensor.implements(aten.is_pinned.default)
def _is_pinned(func, types, args, kwargs):
    return all(t.is_pinned() for t in args[0].tensor_fields().values())
