"""hf_aoq's own CPU kernels, compiled from csrc/ on first use, once per machine (build_cache.py).

Where aten has no fused kernel for a format (float8 weights on CPU), or its kernel is slow (int4
and int8 weights with float32 activations, or at many rows), a small C++ loop beats any
composition of aten ops. Each csrc/*.cpp in SOURCES is its own translation unit; the headers hold
what they share. The first use announces the build (about a minute) and caches the binary, keyed
by what it depends on, for every later process; when no build is possible (no compiler, no ninja,
another process's build outlasting HF_AOQ_EXTENSION_WAIT seconds) `load()` warns and returns
None, and the kernel table falls back to the reference kernels.
"""
from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import torch

from . import build_cache, cpu_isa

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("int4.cpp", "int4dq.cpp", "int4dq_search.cpp", "int8.cpp", "int8dyn.cpp", "int8_int4.cpp", "fp8.cpp",
           "linear_io.cpp", "mx.cpp", "mx_quant.cpp", "intx.cpp", "nvfp4.cpp", "fpx.cpp", "fp8_sparse.cpp", "nvfp4_quant.cpp",
           "amx.cpp", "bandwidth.cpp", "dense.cpp", "attention.cpp", "dispatch.cpp")
HEADER = "hf_aoq_cpu.h"  # declares FUNCTIONS
FUNCTIONS = [
    "fp8_linear", "fp8_dequant_linear", "int4pack_linear", "int8_linear",
    "int4pack_linear_io", "int8_linear_io", "int8dyn_linear_io", "fp8_linear_io", "int4_repack_pairs",
    "int4dq_linear", "int4dq_linear_io", "int4dq_cpu_rows", "int4dq_row_params", "int4dq_search",
    "int4pack_dequantize", "int4dq_dequantize", "int8_dequantize", "fp8_dequantize",
    "mx_linear_io", "mx_quantize_rows", "mx_fake_quantize", "mx_dequantize", "int8_int4_linear_io", "intx_linear_io",
    "intx_dequantize", "intxdq_linear_io", "intxdq_dequantize", "nvfp4_linear_io", "fpx_linear_io", "fpx_dequantize",
    "fp8_sparse_linear_io", "fp8_sparse_dequantize",
    "nvfp4_quantize_rows", "nvfp4_fake_quantize", "nvfp4_dequantize",
    "int4pack_amx_linear", "int4dq_amx_linear", "int8_amx_linear", "int8dyn_amx_linear", "int8dyn_vnni_linear",
    "fp8_amx_linear", "fp8_dpbf16_linear", "intx_amx_linear", "intxdq_amx_linear", "amx_available", "read_xor",
    "bf16_linear", "dense_linear_io",
    "decode_attention", "register_cpu_kernels",
]
# No contraction of a separate multiply and add into an FMA: the dequantizing kernels must round
# as the reference does.
CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")
LDFLAGS = ("-fopenmp",)
# Per instruction set: the compiler flags, and the CPU flags (as /proc/cpuinfo names them) that a
# binary built with them needs. The first one the running CPU (and OS: cpu_isa) allows is built.
# avx512: the AVX2 kernels compiled for AVX-512 (F/BW/VL/DQ), with VNNI's vpdpwssd in the int4
# kernel's integer multiply-adds and its 64-row 512-bit step (int4_pairs.h, int4_pairs512.h; the
# same integer sums and float32 operations as the AVX2 build's, so the same outputs).
ISAS = {
    "avx512": (("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
                "-mavx512bf16"),
               ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16")),
    "avx2": (("-mavx2", "-mfma"), ("avx2", "fma")),
    "generic": ((), ()),
}
WAIT_SECONDS = 900.0  # for another process's build of the same binary (HF_AOQ_EXTENSION_WAIT)


def chosen_isa() -> str:
    """The instruction set to build for: the first of ISAS that this CPU has and the OS enables
    (torch's dispatch knows what the OS allows and honours ATEN_CPU_CAPABILITY; HF_AOQ_CPU_ISA
    takes AVX-512 away, see cpu_isa), never what the build machine has."""
    have = build_cache.cpu_features()
    torch_cap = torch.backends.cpu.get_cpu_capability()
    allowed = {"avx512": cpu_isa.avx512_allowed(), "avx2": torch_cap in ("AVX2", "AVX512"), "generic": True}
    for isa, (_, needs) in ISAS.items():
        if set(needs) <= have and allowed.get(isa, False):
            return isa
    return "generic"


def extension() -> build_cache.Extension:
    """What the binary for this machine is made of (its cache key)."""
    isa = chosen_isa()
    isa_flags, needs = ISAS[isa]
    files = tuple((p.name, p.read_bytes()) for p in sorted(CSRC.iterdir()) if p.suffix in (".cpp", ".h"))
    return build_cache.Extension(
        prefix="hf_aoq_cpu", files=files, sources=SOURCES, functions=tuple(FUNCTIONS), header=HEADER,
        cflags=CFLAGS + isa_flags, ldflags=LDFLAGS, isa=isa, cpu_features=needs,
        compiler=build_cache.compiler_identity(),
    )


@functools.lru_cache(maxsize=None)
def load():
    """The compiled extension module, or None when it cannot be loaded or built here."""
    if os.environ.get("HF_AOQ_NO_CPU_EXT"):
        return None
    try:
        ext = extension()
        root = build_cache.cache_root()
        announce = (f"hf_aoq: compiling its C++ CPU kernels for {ext.isa.upper()} (once per machine and torch "
                    f"version; about a minute, longer on a busy machine) into {root}")
        wait_s = float(os.environ.get("HF_AOQ_EXTENSION_WAIT", WAIT_SECONDS))
        mod = build_cache.load_or_build(ext, announce=announce, wait_s=wait_s, root=root)
    except Exception as e:  # noqa: BLE001 - any build failure means: use the fallback
        warnings.warn(f"hf_aoq: CPU extension unavailable, using reference kernels ({type(e).__name__}: {e})")
        return None
    _register_with_dispatcher(mod)
    return mod


def _register_with_dispatcher(mod) -> None:
    """The opaque ops' CPU kernels (csrc/dispatch.cpp) as their dispatcher kernels, so that a
    compiled graph calls the C++ without a call into Python per op. The ops are defined first (the
    modules that declare them); should a schema not match, the ops keep their Python kernels."""
    from . import cpu, cpu_attention, cpu_dense  # noqa: F401 - define the ops dispatch.cpp registers

    try:
        mod.register_cpu_kernels()
    except RuntimeError as e:
        warnings.warn(f"hf_aoq: the CPU kernels are not registered with torch's dispatcher; compiled graphs call "
                      f"them through Python ({e})")


@torch._dynamo.assume_constant_result
def available() -> bool:
    """Whether the extension is built (building it on first call); a constant under torch.compile."""
    return load() is not None
