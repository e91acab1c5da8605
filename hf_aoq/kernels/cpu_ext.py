"""hf_aoq's own CPU kernels, compiled from csrc/ on first use with torch's C++ extension tools.

Where aten has no fused kernel for a format (float8 weights on CPU), or its kernel is slow (int4
and int8 weights with float32 activations, or at many rows), a small C++ loop beats
any composition of aten ops. The build happens once per machine (torch caches it); when it is
impossible (no compiler, no ninja) `load()` returns None and the kernel table falls back.
"""
from __future__ import annotations

import functools
import hashlib
import os
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("simd.cpp", "dequant_gemm.cpp", "fp8_cpu.cpp", "int_cpu.cpp", "linear_io.cpp")  # in this order: one translation unit
FUNCTIONS = [
    "fp8_linear", "fp8_dequant_linear", "int4pack_linear", "int8_linear",
    "int4pack_linear_io", "int8_linear_io", "fp8_linear_io", "int4_repack_pairs",
    "int4dq_linear", "int4dq_linear_io", "int4dq_row_params", "int4dq_search",
]


@functools.lru_cache(maxsize=None)
def load():
    """The compiled extension module, or None when it cannot be built here."""
    if os.environ.get("HF_AOQ_NO_CPU_EXT"):
        return None
    try:
        from torch.utils import cpp_extension

        # No contraction of a separate multiply and add into an FMA: the dequantizing kernels
        # must round as the reference does.
        flags = ["-O3", "-ffp-contract=off"]
        if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
            flags += ["-mavx2", "-mfma"]
        sources = [(CSRC / name).read_text() for name in SOURCES]
        # The name carries a digest of what is built: a changed kernel (a new hf_aoq) is a new
        # module, never a stale build of the old one that torch's cache or a concurrent build
        # left behind under the same name.
        digest = hashlib.sha256("\0".join(sources + FUNCTIONS + flags).encode()).hexdigest()[:12]
        return cpp_extension.load_inline(
            name="hf_aoq_cpu_" + torch.__version__.replace(".", "_").replace("+", "_") + "_" + digest,
            cpp_sources=sources,
            functions=FUNCTIONS,
            extra_cflags=flags + ["-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - any build failure means: use the fallback
        warnings.warn(f"hf_aoq: CPU extension unavailable, using reference kernels ({type(e).__name__}: {e})")
        return None


@torch._dynamo.assume_constant_result
def available() -> bool:
    """Whether the extension is built (building it on first call); a constant under torch.compile."""
    return load() is not None
