"""hf_aoq's own CPU kernels, compiled from csrc/ on first use with torch's C++ extension tools.

Where aten has no fused kernel for a format (float8 weights on CPU), a small C++ loop beats
any composition of aten ops. The build happens once per machine (torch caches it); when it is
impossible (no compiler, no ninja) `load()` returns None and the kernel table falls back.
"""
from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).with_name("csrc")


@functools.lru_cache(maxsize=None)
def load():
    """The compiled extension module, or None when it cannot be built here."""
    if os.environ.get("HF_AOQ_NO_CPU_EXT"):
        return None
    try:
        from torch.utils import cpp_extension

        flags = ["-O3"]
        if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
            flags += ["-mavx2", "-mfma"]
        source = (CSRC / "fp8_cpu.cpp").read_text()
        return cpp_extension.load_inline(
            name="hf_aoq_cpu_" + torch.__version__.replace(".", "_").replace("+", "_"),
            cpp_sources=[source],
            functions=["fp8_linear"],
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
