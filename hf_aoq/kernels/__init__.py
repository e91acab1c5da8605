"""Kernel and packing tables: which function runs an op for a tensor type, chosen by lookup.

A `Kernel` is a function plus the condition under which it applies; `select_kernel` walks the
kernels registered for (op, tensor type) from the highest priority down and returns the first
that applies. The reference kernel (dequantize, then the float op) is registered for every
type at the lowest priority, so a choice always exists and tests can compare every other
kernel with it.

A `Packing` is a device-specific rearrangement of a tensor's fields that some kernel needs. It
is made when a tensor is placed on a device and undone (`unpack`) before saving.

Kernels and packings see quantized tensors only through their declared fields (`w.qdata`,
`w.scale`, ...), so this package imports no tensor type; entries are keyed by type name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Kernel:
    name: str
    op: str
    type_name: str
    backend: str
    priority: int
    applies: Callable[..., bool]
    fn: Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Packing:
    name: str
    type_name: str
    device_type: str
    priority: int
    available: Callable[[Any], bool]  # canonical weight -> can this packing hold it?
    pack: Callable[[Any], Any]  # canonical weight -> packed weight
    unpack: Callable[[Any], Any]  # packed weight -> canonical weight


_KERNELS: dict[tuple[str, str], list[Kernel]] = {}
_PACKINGS: dict[str, Packing] = {}


def _always(*args) -> bool:
    return True


def register_kernel(op: str, type_name: str, name: str, *, backend: str, priority: int, applies=None):
    """Decorator: register `fn(x, weight, *rest)` as a kernel for `op` on `type_name`."""

    def register(fn):
        kernels = _KERNELS.setdefault((op, type_name), [])
        if any(k.name == name for k in kernels):
            raise ValueError(f"kernel {name!r} registered twice for {op} on {type_name}")
        kernels.append(Kernel(name, op, type_name, backend, priority, applies or _always, fn))
        kernels.sort(key=lambda k: -k.priority)
        return fn

    return register


def kernels_for(op: str, type_name: str) -> list[Kernel]:
    return list(_KERNELS.get((op, type_name), ()))


def select_kernel(op: str, x: torch.Tensor, weight) -> Kernel:
    type_name = type(weight).__name__
    for kernel in _KERNELS.get((op, type_name), ()):
        if kernel.applies(x, weight):
            return kernel
    raise NotImplementedError(f"no kernel for {op} with a {type_name} weight")


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return select_kernel("linear", x, weight).fn(x, weight, bias)


def embedding(indices: torch.Tensor, weight, padding_idx=None) -> torch.Tensor:
    return select_kernel("embedding", indices, weight).fn(indices, weight, padding_idx)


def register_packing(packing: Packing) -> Packing:
    if packing.name in _PACKINGS:
        raise ValueError(f"packing {packing.name!r} registered twice")
    _PACKINGS[packing.name] = packing
    return packing


def get_packing(name: str) -> Packing:
    try:
        return _PACKINGS[name]
    except KeyError:
        raise ValueError(f"unknown packing {name!r}; known: {sorted(_PACKINGS)}") from None


def best_packing(weight) -> Packing | None:
    """The highest-priority packing for this canonical weight on its device, if any fits."""
    candidates = [
        p
        for p in _PACKINGS.values()
        if p.type_name == type(weight).__name__ and p.device_type == weight.device.type
    ]
    for p in sorted(candidates, key=lambda p: -p.priority):
        if p.available(weight):
            return p
    return None


from . import reference, cpu, cuda  # noqa: E402,F401  (populate the tables)
