"""The kernel table: which function runs an op on a quantized weight, found by one lookup.

A row of the table is a `Kernel`: an op ("linear", "embedding"), the tensor type it is for (by
class name; a subclass finds its bases' kernels through its MRO), the packings it reads, the
device type it runs on, the capabilities it needs and a per-call condition on shapes and dtypes.
`select_kernel` walks the weight's MRO and, for each class, the rows for (op, class, packing) by
priority; the first row whose device, capabilities and condition hold runs. The answer is
remembered on the weight for the input's dtype, device, shape and contiguity and the grad mode
(what a condition may read besides the weight's fields), and asked again after any change to the
table, the capabilities (`forget_capabilities`) or the weight's fields.

A `Packing` is a device-specific layout of a type's fields that some kernels read; placement
(`best_packing`) only picks a packing that a kernel capable on the device reads, so a packing
names the kernels that can run it (`Packing.kernels`). `unpack` gives the canonical layout back.
A packing that `keeps_layout` is the canonical layout plus a guarantee (Int8's: codes contiguous
and aligned); kernels that read canonical weights read it too. A packing that `helps_canonical_readers`
adds what kernels that also read the canonical layout would otherwise derive per call (IntxDQ's
decoded row table): placement makes it wherever one of them runs.

A `Capability` is what a device allows (hf_aoq's C++ extension built, an aten op present, a CUDA
compute capability, a CPU instruction set); each is probed once per device and then read from a
cache, also under torch.compile. What they are on this machine is part of torch.compile's cache
key (`compile_key`): a graph compiled where other kernels ran is not reused.

`OpaqueOp` is the one eager/compiled switch: a kernel that calls code torch.compile must not
trace (C++ extension functions, aten ops Inductor cannot lower) declares it as an op here; eager
calls go straight to the function (an op's dispatch costs as much as a small layer's kernel at
batch 1), compiled graphs see the opaque op.

This module imports no tensor type: kernels see weights only through their declared fields.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..core import tensor as core_tensor

CANONICAL = None  # the packing value of a tensor in its canonical (saved) layout
ANY = "*"  # a kernel that reads every packing (it canonicalizes the weight itself)


# ---------------------------------------------------------------------- capabilities
@dataclass(frozen=True)
class Capability:
    name: str
    device_type: str  # the devices it is about
    probe: Callable[[torch.device], bool]  # evaluated once per device


_CAPABILITIES: dict[str, Capability] = {}
_CAPABLE: dict[tuple[str, str, int], bool] = {}


def capability(name: str, device_type: str, probe: Callable[[torch.device], bool]) -> Capability:
    """Declare a capability (once per name) of `device_type` devices and return it."""
    if name in _CAPABILITIES:
        raise ValueError(f"capability {name!r} declared twice")
    cap = _CAPABILITIES[name] = Capability(name, device_type, probe)
    return cap


@torch._dynamo.assume_constant_result
def _capable(name: str, device_type: str, index: int) -> bool:
    key = (name, device_type, index)
    known = _CAPABLE.get(key)
    if known is None:
        device = torch.device(device_type) if index < 0 else torch.device(device_type, index)
        known = _CAPABLE[key] = bool(_CAPABILITIES[name].probe(device))
    return known


def capable(needs: tuple[Capability, ...], device: torch.device) -> bool:
    """Whether `device` has every capability in `needs` (each probed once per device)."""
    if not needs:
        return True
    device_type, index = device.type, device.index
    if index is None:
        index = torch.cuda.current_device() if device_type == "cuda" else -1
    for cap in needs:  # a loop, not all(...): this runs on every call of a kernel
        if cap.device_type != device_type or not _capable(cap.name, device_type, index):
            return False
    return True


def compile_key() -> str:
    """What the capabilities are here (the CPU's, and the current GPU's if there is one)."""
    devices = [torch.device("cpu")] + ([torch.device("cuda", torch.cuda.current_device())] if torch.cuda.is_available() else [])
    return ",".join(
        f"{name}={int(capable((cap,), d))}"
        for d in devices
        for name, cap in sorted(_CAPABILITIES.items())
        if cap.device_type == d.type
    )


core_tensor.CACHE_KEY_PARTS.append(compile_key)


def forget_capabilities() -> None:
    """Probe every capability again on next use (tests that change what the machine allows)."""
    _CAPABLE.clear()
    _table_changed()


# ---------------------------------------------------------------------- the eager/compiled switch
def _non_differentiable(ctx, inputs, output) -> None:
    ctx.mark_non_differentiable(*(output if isinstance(output, tuple) else (output,)))


def _no_backward(ctx, *grads):
    raise RuntimeError("hf_aoq's kernels have no backward; their outputs are marked non-differentiable")


_LIBRARY = torch.library.Library("hf_aoq", "FRAGMENT")  # every OpaqueOp's definition
_OPAQUE_OPS: dict[str, "OpaqueOp"] = {}  # qualified name -> op, as declared


class OpaqueOp:
    """`fn` as the op `hf_aoq::<name>` under torch.compile, and `fn` itself in eager mode.
    `fake(*args)` returns an empty tensor of the output's shape and dtype.

    The op is defined on a `torch.library.Library` (schema from `fn`'s annotations, `fn` as its
    kernel for every device, `fake` for tracing), not with `torch.library.custom_op`: a compiled
    graph calls the op once per quantized layer, and custom_op's Python wrapper around the kernel
    (backend lookup, output aliasing check) costs 2.4 us a call over the bare registration (7.0
    against 4.6 us for a tiny call of the op under inference_mode, AMD EPYC Zen 4): about the
    kernel's own time for a small layer at batch 1. What custom_op would add is kept by hand: the
    pt2_compliant tag, and autograd told that the output is not differentiable; the tests run
    torch.library.opcheck on the ops."""

    def __init__(self, name: str, fn: Callable[..., torch.Tensor], fake: Callable[..., torch.Tensor]):
        self.eager = fn
        self.qualname = f"hf_aoq::{name}"
        schema = torch.library.infer_schema(fn, mutates_args=())
        _LIBRARY.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
        _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(self.qualname, fake, lib=_LIBRARY)
        # The eager call records no autograd graph (C++ code fills the output): its output never
        # requires grad. Said to autograd, so that a graph compiled with grad enabled does the same
        # instead of failing for want of a backward formula.
        torch.library.register_autograd(self.qualname, _no_backward, setup_context=_non_differentiable, lib=_LIBRARY)
        self.op = getattr(torch.ops.hf_aoq, name).default
        _OPAQUE_OPS[self.qualname] = self

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return self.op(*args)
        return self.eager(*args)


def opaque_ops() -> dict[str, OpaqueOp]:
    """Every op declared so far (by the kernel modules imported), by qualified name."""
    return dict(_OPAQUE_OPS)


def opaque_op(name: str, fake: Callable[..., torch.Tensor]) -> Callable[[Callable], OpaqueOp]:
    """Decorator form of `OpaqueOp`: the function's annotations give the op's schema."""
    return lambda fn: OpaqueOp(name, fn, fake)


# ---------------------------------------------------------------------- kernels and packings
def _always(x, w) -> bool:
    return True


@dataclass(frozen=True)
class Kernel:
    name: str
    op: str
    type_name: str
    reads: tuple[str | None, ...]  # packings it reads: CANONICAL (None), names, or ANY
    device_type: str | None  # None: any device
    needs: tuple[Capability, ...]
    when: Callable[[Any, Any], bool]  # per call: shapes, dtypes, contiguity
    fn: Callable[..., torch.Tensor]
    priority: int
    backend: str

    def reads_packing(self, packing: str | None) -> bool:
        if packing in self.reads or ANY in self.reads:
            return True
        # A packing that keeps the canonical layout (and only adds a guarantee) is canonical too.
        return CANONICAL in self.reads and packing in _PACKINGS and _PACKINGS[packing].keeps_layout

    def applies(self, x: torch.Tensor, w) -> bool:
        """Every condition of this row for input `x` and weight `w`."""
        return (
            self.reads_packing(getattr(w, "packing", None))
            and (self.device_type is None or x.device.type == self.device_type)
            and capable(self.needs, x.device)
            and self.when(x, w)
        )


@dataclass(frozen=True)
class Packing:
    name: str
    type_name: str
    device_type: str
    priority: int
    available: Callable[[Any], bool]  # canonical weight -> can this packing hold it?
    pack: Callable[[Any], Any]  # canonical weight -> packed weight
    unpack: Callable[[Any], Any]  # packed weight -> canonical weight
    needs: tuple[Capability, ...] = field(default=())  # what `pack` itself needs
    keeps_layout: bool = False  # the canonical layout plus a guarantee: canonical kernels read it too
    # Read by kernels that read the canonical layout too, faster from this one: worth making for them.
    helps_canonical_readers: bool = False

    def kernels(self, op: str = "linear") -> list[Kernel]:
        """The kernels that read this packing, best first (not the reference, which reads all)."""
        return [k for k in _TABLE.get((op, self.type_name, self.name), ()) if ANY not in k.reads]


_KERNELS: dict[tuple[str, str], list[Kernel]] = {}  # (op, type name) -> rows, best first
_PACKINGS: dict[str, Packing] = {}
_TABLE: dict[tuple[str, str, str | None], tuple[Kernel, ...]] = {}  # (op, type, packing) -> rows


def _rebuild() -> None:
    """(op, type, packing) -> rows, ANY rows expanded over the type's known packings; a packing's
    rows are those of its device (or of any device)."""
    _table_changed()
    _TABLE.clear()
    for (op, type_name), rows in _KERNELS.items():
        device_of = {CANONICAL: None, **{p.name: p.device_type for p in _PACKINGS.values() if p.type_name == type_name}}
        for packing, device in device_of.items():
            chosen = tuple(
                k for k in rows if k.reads_packing(packing) and (device is None or k.device_type in (None, device))
            )
            if chosen:
                _TABLE[(op, type_name, packing)] = chosen


def register_kernel(
    op: str,
    type_name: str,
    name: str,
    *,
    backend: str,
    priority: int,
    reads: tuple[str | None, ...] = (CANONICAL,),
    device: str | None = None,
    needs: tuple[Capability, ...] = (),
    when: Callable[[Any, Any], bool] | None = None,
):
    """Decorator: register `fn(x, weight, *rest)` as a row of the table."""

    def register(fn):
        rows = _KERNELS.setdefault((op, type_name), [])
        if any(k.name == name for k in rows):
            raise ValueError(f"kernel {name!r} registered twice for {op} on {type_name}")
        unknown = [p for p in reads if p not in (CANONICAL, ANY) and p not in _PACKINGS]
        if unknown:
            raise ValueError(f"kernel {name!r} reads unregistered packings {unknown}; register them first")
        rows.append(Kernel(name, op, type_name, tuple(reads), device, tuple(needs), when or _always, fn, priority, backend))
        rows.sort(key=lambda k: -k.priority)
        _rebuild()
        return fn

    return register


def register_packing(packing: Packing) -> Packing:
    if packing.name in _PACKINGS:
        raise ValueError(f"packing {packing.name!r} registered twice")
    _PACKINGS[packing.name] = packing
    _rebuild()
    return packing


# The choice is remembered per weight (in its KERNEL_CACHE attribute, which setting any field
# drops), keyed by what a row's condition may read besides the weight's fields: the op, x's dtype,
# device, shape and contiguity, and the grad mode; and by `_version`, which every change to the
# table or to what the capabilities are bumps. Decode asks the same question of every weight on
# every token: a few microseconds of walking rows and probing capabilities, per linear, per token.
_version = 0
_CHOICES_PER_WEIGHT = 64  # distinct input shapes remembered (prefill lengths); then start over


def _table_changed() -> None:
    global _version
    _version += 1


def select_kernel(op: str, x: torch.Tensor, weight) -> Kernel:
    """The first row, through the weight's MRO and by priority, whose conditions hold. A row's
    `when(x, w)` may read the weight's fields and x's dtype, device, shape and contiguity and the
    grad mode: the answer is remembered for those (not while torch.compile traces)."""
    if not isinstance(weight, core_tensor.AOQTensor) or torch.compiler.is_compiling():
        return _select(op, x, weight)
    key = (op, x.dtype, x.device, x.shape, x.is_contiguous(), torch.is_grad_enabled())
    known = weight.__dict__.get(core_tensor.KERNEL_CACHE)
    if known is None or known[0] != _version:
        known = weight.__dict__[core_tensor.KERNEL_CACHE] = (_version, {})
    choices = known[1]
    kernel = choices.get(key)
    if kernel is None:
        kernel = _select(op, x, weight)
        if len(choices) >= _CHOICES_PER_WEIGHT:
            choices.clear()
        choices[key] = kernel
    return kernel


def _select(op: str, x: torch.Tensor, weight) -> Kernel:
    packing = getattr(weight, "packing", None)
    device = x.device
    for cls in type(weight).__mro__:
        for kernel in _TABLE.get((op, cls.__name__, packing), ()):
            if (
                (kernel.device_type is None or device.type == kernel.device_type)
                and capable(kernel.needs, device)
                and kernel.when(x, weight)
            ):
                return kernel
    raise NotImplementedError(f"no kernel for {op} with a {type(weight).__name__} weight (packing {packing!r})")


def kernels_for(op: str, type_name: str) -> list[Kernel]:
    """Every row registered for (op, type), best first (the reference last)."""
    return list(_KERNELS.get((op, type_name), ()))


def get_packing(name: str) -> Packing:
    try:
        return _PACKINGS[name]
    except KeyError:
        raise ValueError(f"unknown packing {name!r}; known: {sorted(_PACKINGS)}") from None


def best_packing(weight) -> Packing | None:
    """The packing placement gives this canonical weight on its device: through the MRO, by
    priority, the first that holds it, can be made here and is read by a kernel that runs here."""
    device = weight.device
    for cls in type(weight).__mro__:
        candidates = [p for p in _PACKINGS.values() if p.type_name == cls.__name__ and p.device_type == device.type]
        for p in sorted(candidates, key=lambda p: -p.priority):
            # Worth making only for a kernel that runs here and does not read the canonical layout
            # (or reads it more slowly: helps_canonical_readers).
            runnable = any(
                capable(k.needs, device) and (p.helps_canonical_readers or not k.reads_packing(CANONICAL))
                for op in _ops() for k in p.kernels(op)
            )
            if runnable and capable(p.needs, device) and p.available(weight):
                return p
    return None


def _ops() -> set[str]:
    return {op for op, _ in _KERNELS}


def table() -> list[tuple[str, str, str, str]]:
    """The table as (op, type, packing, kernel) rows, best kernel first for each (op, type,
    packing); "canonical" for the canonical layout."""
    return [
        (op, type_name, "canonical" if packing is None else packing, k.name)
        for (op, type_name, packing), rows in sorted(_TABLE.items(), key=lambda kv: (kv[0][0], kv[0][1], str(kv[0][2])))
        for k in rows
    ]
