"""The scheme names (`hf-aoq quantize --scheme`, the scripts) and the one function that builds
their configs."""
from __future__ import annotations


import torch

from ..core.errors import AOQError
from ..core.granularity import PerGroup
from ..tensors import intx, mx, nvfp4
from .recipe import AOQBaseConfig
from .float8 import (Float8DynamicActivationFloat8SemiSparseWeightConfig, Float8DynamicActivationFloat8WeightConfig,
                     Float8StaticActivationFloat8WeightConfig, Float8WeightOnlyConfig)
from .integer import (Float8DynamicActivationInt4WeightConfig, Int4DQWeightOnlyConfig, Int4DynamicActivationInt4WeightConfig,
                      Int4WeightOnlyConfig, Int8DynamicActivationInt4WeightConfig, Int8DynamicActivationInt8WeightConfig,
                      Int8WeightOnlyConfig, IntxDQWeightOnlyConfig)
from .intx import INT_DTYPES_BY_BITS, Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig
from .microscaling import MXFPInferenceConfig, NVFP4InferenceConfig, NVFP4WeightOnlyConfig
from .fpx import FPXWeightOnlyConfig


# ---------------------------------------------------------------------- schemes by name
# The names `hf-aoq quantize --scheme` and the scripts take; one function builds their configs.
SCHEMES = ("int4", "int4-plain", "int8", "int8-dyn", "fp8", "fp8-dyn", "mxfp8", "mxfp4",
           "int2", "int3", "int5", "int6", "int8-int2", "int8-int3", "int8-int5", "int8-int6",
           "int8-int4", "fp8-int4", "int4-int4", "fp8-static", "nvfp4", "nvfp4-wo", "fp6", "fp8-sparse",
           "int2-asym", "int3-asym", "int5-asym", "int6-asym", "int3-dq", "int2-dq")
INTX_SCHEME_BITS = {"int2": 2, "int3": 3, "int5": 5, "int6": 6}
# "intN-asym": the same IntxTensor with a zero per group as well as a scale (N + 32/g bits with bf16 parameters).
_ASYM = "-asym"
INTX_DEFAULT_GROUP = 32
# "intN-dq": IntxDQTensor, N-bit codes with Int4DQ's 4-bit group parameters (N + 8/g + 32/K bits).
DQ_SCHEME_BITS = {"int3-dq": 3, "int2-dq": 2}
# The activation-quantized int4 schemes: their configs take `group_size` as Int4WeightOnlyConfig does.
_INT4_ACT_SCHEMES = {
    "int8-int4": Int8DynamicActivationInt4WeightConfig,
    "fp8-int4": Float8DynamicActivationInt4WeightConfig,
    "int4-int4": Int4DynamicActivationInt4WeightConfig,
}


def config_for_scheme(scheme: str, group_size: int | None = None) -> AOQBaseConfig:
    """The config a scheme name stands for. One rule: a scheme names one tensor type, and
    `group_size` only changes that type's group size. int4 is Int4DQWeightOnlyConfig (groups of
    32, or 64, with 4-bit group parameters: about the size of plain int4 in groups of 128 and far
    more accurate); int4-plain is Int4WeightOnlyConfig (a float scale and zero per group of 128,
    or 32, 64, 256; what GPTQ calibration chooses); int8 (per row, or groups of `group_size`),
    int8-dyn, fp8 and fp8-dyn (per row, e4m3; no groups); mxfp8 and mxfp4 are MXFPInferenceConfig
    with e4m3 or e2m1 weights and e4m3 activations, both in MX blocks of 32 (their only size);
    nvfp4 and nvfp4-wo are NVFP4InferenceConfig (NVFP4 activations) and NVFP4WeightOnlyConfig, in
    blocks of 16 (their only size);
    int2, int3, int5 and int6 are IntxWeightOnlyConfig, symmetric, in groups of 32 (or 16, 64,
    128, 256); int8-int2 .. int8-int6 are Int8DynamicActivationIntxWeightConfig with the same
    weights and int8 per-token activations; int2-asym .. int6-asym are the same IntxWeightOnlyConfig
    with mapping_type "asymmetric" (a scale and a zero per group); int3-dq and int2-dq are
    IntxDQWeightOnlyConfig: 3- or 2-bit codes in groups of 32 (or 64) with Int4DQ's 4-bit group
    parameters (3.25 + 32/K bits per weight at 3 bits).
    int8-int4, fp8-int4 and int4-int4 are int4 weights (groups of 32, 128 and 128 by default) with
    int8, float8 (e4m3) or int4 activations quantized per token at run time; fp8-static is
    Float8StaticActivationFloat8WeightConfig, whose activation scales calibration chooses; fp6
    is FPXWeightOnlyConfig(3, 2): e3m2 weights with a scale per row (no groups);
    fp8-sparse is Float8DynamicActivationFloat8SemiSparseWeightConfig with e4m3 activations (2:4
    sparse e4m3 weights, per-token activations as fp8-dyn's; torchao's default is e5m2)."""
    asym = scheme.endswith(_ASYM)
    base = scheme.removesuffix(_ASYM)
    intx_bits = INTX_SCHEME_BITS.get(base.removeprefix("int8-") if base.startswith("int8-int") else base)
    if intx_bits is not None and scheme in SCHEMES:
        g = INTX_DEFAULT_GROUP if group_size is None else group_size
        if g not in intx.GROUP_SIZES:
            raise AOQError(f"scheme {scheme}: group size must be one of {intx.GROUP_SIZES}, got {g}")
        dtype = INT_DTYPES_BY_BITS[intx_bits]
        if scheme.startswith("int8-"):
            return Int8DynamicActivationIntxWeightConfig(weight_dtype=dtype, weight_granularity=PerGroup(g))
        return IntxWeightOnlyConfig(weight_dtype=dtype, granularity=PerGroup(g),
                                    mapping_type="asymmetric" if asym else "symmetric")
    if scheme == "int4":
        return Int4DQWeightOnlyConfig() if group_size is None else Int4DQWeightOnlyConfig(group_size=group_size)
    if scheme in DQ_SCHEME_BITS:
        bits = DQ_SCHEME_BITS[scheme]
        return IntxDQWeightOnlyConfig(bits=bits) if group_size is None else IntxDQWeightOnlyConfig(bits, group_size)
    if scheme == "int4-plain":
        return Int4WeightOnlyConfig() if group_size is None else Int4WeightOnlyConfig(group_size=group_size)
    if scheme == "int8":
        return Int8WeightOnlyConfig(group_size=group_size)
    if scheme in _INT4_ACT_SCHEMES:
        cls = _INT4_ACT_SCHEMES[scheme]
        return cls() if group_size is None else cls(group_size=group_size)
    if scheme not in SCHEMES:
        raise AOQError(f"unknown scheme {scheme!r}; known: {', '.join(SCHEMES)}")
    if scheme in ("mxfp8", "mxfp4"):
        if group_size not in (None, mx.BLOCK_SIZE):
            raise AOQError(f"scheme {scheme} has MX blocks of {mx.BLOCK_SIZE} only, got group size {group_size}")
        weight = torch.float8_e4m3fn if scheme == "mxfp8" else mx.FP4
        return MXFPInferenceConfig(activation_dtype=torch.float8_e4m3fn, weight_dtype=weight)
    if scheme in ("nvfp4", "nvfp4-wo"):
        if group_size not in (None, nvfp4.BLOCK_SIZE):
            raise AOQError(f"scheme {scheme} has NVFP4 blocks of {nvfp4.BLOCK_SIZE} only, got group size {group_size}")
        return NVFP4InferenceConfig() if scheme == "nvfp4" else NVFP4WeightOnlyConfig()
    if scheme == "fp8-sparse" and group_size is None:
        return Float8DynamicActivationFloat8SemiSparseWeightConfig(activation_dtype=torch.float8_e4m3fn)
    if group_size is not None:
        raise AOQError(f"scheme {scheme} has no group size (it is per row); drop the group size or use int4/int8")
    return {
        "int8-dyn": Int8DynamicActivationInt8WeightConfig,
        "fp8": Float8WeightOnlyConfig,
        "fp8-dyn": Float8DynamicActivationFloat8WeightConfig,
        "fp8-static": Float8StaticActivationFloat8WeightConfig,
        "fp6": FPXWeightOnlyConfig,
    }[scheme]()
