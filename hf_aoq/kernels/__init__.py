"""Kernels: which function runs F.linear / F.embedding on a quantized weight, by one table lookup.

The table (registry.py) has one row per kernel: (op, tensor type, packings it reads, device
type, capabilities, per-call condition) -> function. `select_kernel(op, x, w)` walks w's MRO
(so a subclass of Int4Tensor runs Int4Tensor's kernels) and, for each class, the rows for
(op, class name, w.packing) by priority, and runs the first whose device, capabilities (probed
once per device: hf_aoq's C++ extension built, an aten op present, a CUDA compute capability)
and condition (shapes, dtypes) hold; the choice is remembered per weight and input signature
(registry.select_kernel says what invalidates it). `table()` lists every row.

Packings are device layouts some kernels read (`Packing.kernels()` names them); `place()` picks,
via `best_packing`, the best one that a kernel capable on the device reads, and `to_canonical()`
undoes it (`get_packing`). Kernels that call C++ or ops Inductor cannot lower go through
`OpaqueOp`, the one place that decides between the eager call and torch.compile's opaque op.

The backends, one file each, register their rows: reference.py (dequantize, then the float op:
every type, every packing, every device; what tests compare against), cpu.py (aten's CPU int4
and int8 kernels and hf_aoq's own C++ ones, csrc/), cuda.py (tinygemm, `_int_mm`,
`_scaled_mm`; tinygemm_layout.py transcribes tinygemm's int4 layout), triton_kernels.py (Triton
kernels, triton_jit.py, where triton is installed). Adding a kernel is one `register_kernel` row in its backend's file (plus a
`register_packing` if it reads a layout of its own); `place()` also puts a weight's large CPU
buffers on transparent huge pages (hugepages.py); adding a tensor type adds its name to
reference.TYPES and its rows, nothing else here. Kernels see weights only through their
declared fields (`w.qdata`, `w.scale`, ...), so this package imports no tensor type.
Quantize-time work that has a C++ version (search.py) is reached through one function each,
with its torch fallback, so that tensors/ never calls the extension.
"""
from __future__ import annotations

import torch

from .hugepages import fields_on_huge_pages  # noqa: F401  (what place() does last, on CPU)
from .registry import (  # noqa: F401  (the public surface of the table)
    ANY,
    CANONICAL,
    Capability,
    Kernel,
    OpaqueOp,
    Packing,
    best_packing,
    capability,
    capable,
    get_packing,
    kernels_for,
    opaque_op,
    register_kernel,
    register_packing,
    select_kernel,
    table,
)


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    s = getattr(weight, "input_scale", None)
    if s is not None:
        # Activation-aware scales stored with the weight (tensors/common.py): every kernel runs
        # on x / s and the weight without them, so each path computes (x / s) @ Wq^T.
        x = (x.float() / s).to(x.dtype)
        weight = weight.replace(input_scale=None)
    return select_kernel("linear", x, weight).fn(x, weight, bias)


def embedding(indices: torch.Tensor, weight, padding_idx=None) -> torch.Tensor:
    return select_kernel("embedding", indices, weight).fn(indices, weight, padding_idx)


from . import reference, cpu, cuda, triton_kernels  # noqa: E402,F401  (populate the table)
from .search import int4dq_search  # noqa: E402,F401
