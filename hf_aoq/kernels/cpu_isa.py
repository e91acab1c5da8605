"""What x86 instruction sets this CPU and its OS allow, checked at run time (never the build machine's flags).

A CPU flag in /proc/cpuinfo says what the processor implements; the OS must also save the
registers (AVX-512's zmm and mask registers, AMX's tile data), and a VM may advertise a feature
its host does not let it use. So each set is confirmed two ways where it can be:
- AVX-512: the flags, and torch's own dispatch (cpuinfo reads XCR0, what the OS enabled) choosing
  its AVX512 kernels (`torch.backends.cpu.get_cpu_capability()`, which ATEN_CPU_CAPABILITY lowers).
- AMX: the flags, and the Linux kernel granting this process the tile data state
  (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, then read back with ARCH_GET_XCOMP_PERM);
  without that grant the first tile instruction faults.
HF_AOQ_CPU_ISA (a comma-separated subset of "avx512", "amx", or "none") takes sets away, never
adds one: for tests and for comparing kernels on one machine.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys

import torch

from . import build_cache

AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16")
AMX_FLAGS = ("amx_tile", "amx_bf16")

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def _allowed_by_env(name: str) -> bool:
    value = os.environ.get("HF_AOQ_CPU_ISA")
    if value is None:
        return True
    return name in {v.strip().lower() for v in value.split(",")}


def avx512_allowed() -> bool:
    """AVX-512 F/BW/VL/DQ with VNNI and BF16, implemented and enabled by the OS."""
    return (
        _allowed_by_env("avx512")
        and set(AVX512_FLAGS) <= build_cache.cpu_features()
        and torch.backends.cpu.get_cpu_capability() == "AVX512"
    )


@functools.lru_cache(maxsize=None)
def _amx_permitted() -> bool:
    """Whether Linux grants this process AMX tile data (asks once; the grant is per process)."""
    if not sys.platform.startswith("linux") or os.uname().machine != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
            return False
        bits = ctypes.c_uint64(0)
        if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(bits)) != 0:
            return False
        return bool(bits.value & (1 << _XFEATURE_XTILEDATA))
    except (OSError, AttributeError):
        return False


def amx_bf16_allowed() -> bool:
    """AMX tiles with BF16 multiplies, implemented and granted to this process by the kernel."""
    return _allowed_by_env("amx") and set(AMX_FLAGS) <= build_cache.cpu_features() and _amx_permitted()


def amx_int8_allowed() -> bool:
    """AMX tiles with int8 multiplies (TDPBSSD), implemented and granted to this process."""
    return amx_bf16_allowed() and "amx_int8" in build_cache.cpu_features()


def bf16_gemm_isa() -> str | None:
    """The instruction set aten's (oneDNN's) bf16 GEMM runs on here: "amx", "avx512_bf16", or None
    when it has neither (then a bf16 GEMM is an emulation slower than float32)."""
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return None
    if amx_bf16_allowed():
        return "amx"
    if avx512_allowed():
        return "avx512_bf16"
    return None


def describe() -> dict:
    """What the benchmark and the tests report about this machine."""
    flags = build_cache.cpu_features()
    model = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    interesting = ("avx2", "fma", "avx_vnni", *AVX512_FLAGS, "avx512_fp16", *AMX_FLAGS, "amx_int8", "amx_fp16")
    return {
        "cpu": model or "unknown",
        "flags": [f for f in interesting if f in flags],
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "avx512": avx512_allowed(),
        "amx_bf16": amx_bf16_allowed(),
        "amx_int8": amx_int8_allowed(),
        "bf16_gemm": bf16_gemm_isa(),
    }
