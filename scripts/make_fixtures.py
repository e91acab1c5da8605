#!/usr/bin/env python
"""Write the fixture checkpoints in tests/fixtures/, one generation at a time. Each generation is
written once, by the release that introduced what it covers, and has its own manifest; the files
are checked in and NEVER regenerated (the script skips a generation whose manifest exists),
because their whole point is that old files keep loading. A later format or schema version, or a
new capability of a type, adds a generation to `GENERATIONS` below.

    manifest.json                 format version 1, schema version 1 of every type
    manifest.partial_groups.json  Int4Tensor with a partial last group (K not a multiple of g)
    manifest.int4dq.json          Int4DQTensor (new type), schema version 1
    manifest.mx.json              MXTensor (new type: OCP MXFP8 / MXFP4), schema version 1
    manifest.intx.json            IntxTensor (new type: 1- to 8-bit bit-packed codes), schema version 1
    manifest.act_variants.json    Int4Tensor with activation attributes (int8, int4, float8 per
                                  token) and Float8Tensor with a static act_scale, schema version 1
    manifest.intx_asym_act.json   IntxTensor with act_quant "per_token_asymmetric" (torchao's int8
                                  asymmetric per-token activations), schema version 1
    manifest.mx3d.json            MXTensor fused experts [E, N, K] (3-D), among them the MXFP4
                                  experts `hf-aoq convert` makes of transformers' Mxfp4 checkpoints
    manifest.nvfp4.json           NVFP4Tensor (new type: NVIDIA FP4, e4m3 block scales of 16 and a
                                  float32 per-tensor scale; 2-D and 3-D experts), schema version 1
    manifest.fpx.json             FPxTensor (new type: sub-byte floats, a scale per row), schema version 1
    manifest.fpx3d.json           FPxTensor fused experts [E, N, K] (3-D)
    manifest.fp8_sparse.json      Float8SemiSparseTensor (new type: 2:4 sparse float8), schema version 1
    manifest.awq_input_scale.json Int4Tensor and Int4DQTensor with the optional input_scale
                                  (AWQ scales that could not fold), schema version 1
    manifest.intxdq.json          IntxDQTensor (new type: 2- and 3-bit codes on Int4DQ's group
                                  grid; 2-D and 3-D experts), schema version 1

For each fixture file F.safetensors it writes
  F.safetensors            an hf_aoq checkpoint (quantized tensors and a few plain ones)
  F.expected.safetensors   plain tensors: for each quantized tensor N, N.input (x, in N's
                           dtype), N.dequantized and N.linear; for each plain tensor N, N itself
and the generation's manifest, which lists every file's SHA-256 and every tensor's type and
attributes.

N.linear is `simulate_input_quantization(x) @ dequantize().T` computed in float64 (for 3-D
experts, that of each expert on the same x, stacked: [E, rows, N]). The inputs
are chosen so that this sum is exact (checked below), so any machine, BLAS or summation order
gives the same bits and the tests can compare exactly.

    .venv/bin/python scripts/make_fixtures.py [--out DIR]
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import re
import sys
from fractions import Fraction

import safetensors.torch
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hf_aoq  # noqa: E402
from hf_aoq import (FPxTensor, Float8SemiSparseTensor, Float8Tensor, Int4DQTensor, Int4Tensor, Int8Tensor, IntxDQTensor, IntxTensor, MXTensor, NVFP4Tensor,  # noqa: E402
                    PerRow, PerTensor)
from hf_aoq import serialization  # noqa: E402
from hf_aoq.core import registry  # noqa: E402

FIXTURES = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures"))
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def weight(seed: int, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0, :4] = torch.tensor([0.3, -0.2, 0.0, 0.01])  # a few outliers and an exact zero
    if k > 32:
        w[1, 32:64] += 0.5  # a group far from zero (exercises the asymmetric zero point)
    return w.to(dtype)


def fixture_input(seed: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    # Few significant bits, so float64 products and sums are exact.
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-4, 5, (3, k), generator=g).float() / 4).to(dtype)


def state_dicts_v1() -> dict[str, dict[str, torch.Tensor]]:
    return {
        "v1_int4": {
            "asym_g32_bf16": Int4Tensor.from_float(weight(1, 16, 128, BF16), group_size=32, qparams="minmax"),
            "asym_g128_f16": Int4Tensor.from_float(weight(2, 8, 256, F16), group_size=128, qparams="minmax"),
            "sym_g64_bf16": Int4Tensor.from_float(weight(3, 16, 128, BF16), group_size=64, symmetric=True, qparams="minmax"),
            "sym_g32_f32": Int4Tensor.from_float(weight(4, 8, 64, F32), group_size=32, symmetric=True, qparams="minmax"),
            "bias": torch.linspace(-1, 1, 16, dtype=BF16),
        },
        "v1_int8": {
            "per_row_bf16": Int8Tensor.from_float(weight(5, 16, 64, BF16)),
            "per_group32_f32": Int8Tensor.from_float(weight(6, 8, 128, F32), group_size=32),
            "per_group64_f16": Int8Tensor.from_float(weight(7, 8, 128, F16), group_size=64),
            "dynamic_per_token_bf16": Int8Tensor.from_float(weight(8, 16, 64, BF16), act_quant="per_token"),
        },
        "v1_float8": {
            "e4m3_per_tensor_bf16": Float8Tensor.from_float(weight(9, 16, 64, BF16), E4M3, PerTensor()),
            "e4m3_per_row_f32": Float8Tensor.from_float(weight(10, 8, 64, F32), E4M3, PerRow()),
            "e5m2_per_row_bf16": Float8Tensor.from_float(weight(11, 16, 64, BF16), E5M2, PerRow()),
            "e5m2_per_tensor_f16": Float8Tensor.from_float(weight(12, 8, 64, F16), E5M2, PerTensor()),
            "dynamic_e4m3_per_row_bf16": Float8Tensor.from_float(
                weight(13, 16, 64, BF16), E4M3, PerRow(), act_quant="per_row"
            ),
            "dynamic_e4m3_per_tensor_e5m2_acts_bf16": Float8Tensor.from_float(
                weight(14, 16, 64, BF16), E4M3, PerRow(), act_quant="per_tensor", act_dtype=E5M2
            ),
        },
        # A small model: one name is a prefix of others (torchao once dropped tensors so).
        "v1_model": {
            "model.embed.weight": Float8Tensor.from_float(weight(15, 32, 64, BF16), E4M3, PerRow()),
            "model.layers.0.proj.weight": Int4Tensor.from_float(weight(16, 16, 64, BF16), group_size=32, qparams="minmax"),
            "model.layers.0.proj.weight_scale": torch.full((16,), 0.5, dtype=BF16),
            "model.layers.0.proj.weight_extra": Int8Tensor.from_float(weight(17, 16, 64, BF16)),
            "model.layers.0.proj.bias": torch.zeros(16, dtype=BF16),
            "model.norm.weight": torch.ones(64, dtype=F32),
        },
    }


def state_dicts_partial_groups() -> dict[str, dict[str, torch.Tensor]]:
    return {
        "v1_int4_partial_groups": {
            # One whole group of 64 and a last one of 32.
            "asym_k96_g64_bf16": Int4Tensor.from_float(weight(18, 16, 96, BF16), group_size=64, qparams="minmax"),
            "sym_k80_g32_f16": Int4Tensor.from_float(weight(19, 8, 80, F16), group_size=32, symmetric=True, qparams="minmax"),
            # A single group, shorter than the group size.
            "asym_k48_g128_f32": Int4Tensor.from_float(weight(20, 16, 48, F32), group_size=128, qparams="minmax"),
            # SmolLM2's hidden size: four groups of 128 and one of 64.
            "asym_k576_g128_bf16": Int4Tensor.from_float(weight(21, 16, 576, BF16), group_size=128, qparams="minmax"),
        },
    }


def state_dicts_int4dq() -> dict[str, dict[str, torch.Tensor]]:
    return {
        "v1_int4dq": {
            "g32_k576_bf16": Int4DQTensor.from_float(weight(22, 16, 576, BF16), group_size=32),
            # Partial last groups: 80 = 2 x 32 + 16; 96 = 64 + 32.
            "g32_k80_f32": Int4DQTensor.from_float(weight(23, 32, 80, F32), group_size=32),
            "g64_k96_f16": Int4DQTensor.from_float(weight(24, 8, 96, F16), group_size=64),
            # An all-zero row and a constant one: the format's codes for zero.
            "g32_k64_special_bf16": Int4DQTensor.from_float(
                torch.cat([torch.zeros(1, 64), torch.full((1, 64), 0.5), weight(25, 14, 64, F32)]).to(BF16),
                group_size=32,
            ),
        },
    }


def state_dicts_mx() -> dict[str, dict[str, torch.Tensor]]:
    fp4 = torch.float4_e2m1fn_x2
    special = torch.cat([torch.zeros(1, 64), torch.full((1, 64), -0.0), weight(31, 6, 64, F32) * 1e-30,
                         weight(32, 8, 64, F32) * 1e4]).to(F32)
    return {
        "v1_mx": {
            # MXFP8, weight-only, both element formats; a partial last block (80 = 2 x 32 + 16).
            "e4m3_k64_bf16": MXTensor.from_float(weight(26, 16, 64, BF16), E4M3),
            "e5m2_k80_f32": MXTensor.from_float(weight(27, 8, 80, F32), E5M2),
            # MXFP4 at SmolLM2's hidden size (18 blocks), and a partial block of 2 (K = 66).
            "e2m1_k576_bf16": MXTensor.from_float(weight(28, 16, 576, BF16), fp4),
            "e2m1_k66_f16": MXTensor.from_float(weight(29, 8, 66, F16), fp4),
            # Dynamic MX activations: the schemes mxfp8 and mxfp4, and e5m2 / e2m1 activations.
            "mxfp8_dyn_e4m3_bf16": MXTensor.from_float(weight(30, 16, 64, BF16), E4M3, act_dtype=E4M3),
            "mxfp4_dyn_e4m3_bf16": MXTensor.from_float(weight(33, 16, 128, BF16), fp4, act_dtype=E4M3),
            "e4m3_dyn_e5m2_f32": MXTensor.from_float(weight(34, 8, 64, F32), E4M3, act_dtype=E5M2),
            "e2m1_dyn_e2m1_bf16": MXTensor.from_float(weight(35, 8, 64, BF16), fp4, act_dtype=fp4),
            # Zero blocks of both signs, blocks whose scale clamps at 2^-127, large ones.
            "e2m1_special_f32": MXTensor.from_float(special, fp4),
            "e4m3_special_f32": MXTensor.from_float(special, E4M3),
        },
    }


def experts_weight(seed: int, e: int, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.stack([weight(seed * 100 + i, n, k, F32) for i in range(e)]).to(dtype)


def state_dicts_mx3d() -> dict[str, dict[str, torch.Tensor]]:
    from hf_aoq.convert.mxfp4 import mx_from_blocks

    fp4 = torch.float4_e2m1fn_x2
    g = torch.Generator().manual_seed(61)
    blocks = torch.randint(0, 256, (2, 16, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 126, (2, 16, 2), generator=g, dtype=torch.uint8)
    return {
        "v1_mx3d": {
            # Fused experts [E, N, K]: weight-only MXFP4, the mxfp8 scheme with a partial last
            # block (80 = 2 x 32 + 16), and MXFP4 weights with e4m3 activations (the mxfp4 scheme).
            "e2m1_experts_bf16": MXTensor.from_float(experts_weight(62, 4, 8, 64, BF16), fp4),
            "mxfp8_dyn_experts_k80_f32": MXTensor.from_float(experts_weight(63, 3, 8, 80, F32), E4M3,
                                                             act_dtype=E4M3),
            "mxfp4_dyn_experts_bf16": MXTensor.from_float(experts_weight(64, 2, 8, 96, BF16), fp4, act_dtype=E4M3),
            # What `hf-aoq convert` writes for a gpt-oss Mxfp4 experts weight (the stored bytes as
            # they are, [E, out, in]), and a plain bias next to it.
            "gpt_oss_mxfp4_experts_bf16": mx_from_blocks(blocks, scales, BF16, "gpt_oss_mxfp4_experts_bf16"),
            "gpt_oss_bias": (torch.arange(32, dtype=F32) / 8).to(BF16).reshape(2, 16),
        },
    }


def state_dicts_intx() -> dict[str, dict[str, torch.Tensor]]:
    return {
        "v1_intx": {
            # Every bit width; symmetric and asymmetric; per row, groups, partial last groups
            # (80 = 2 x 32 + 16; 576 = 4 x 128 + 64); K whose rows end inside a byte (K = 13).
            "int1_asym_g32_bf16": IntxTensor.from_float(weight(40, 8, 64, BF16), 1, 32, symmetric=False),
            "int2_sym_g32_bf16": IntxTensor.from_float(weight(41, 16, 80, BF16), 2, 32),
            "int3_sym_g128_bf16": IntxTensor.from_float(weight(42, 16, 576, BF16), 3, 128),
            "int3_asym_g16_f32": IntxTensor.from_float(weight(43, 8, 80, F32), 3, 16, symmetric=False),
            "int4_asym_g64_f16": IntxTensor.from_float(weight(44, 8, 128, F16), 4, 64, symmetric=False),
            "int5_sym_row_bf16": IntxTensor.from_float(weight(45, 8, 13, BF16), 5, None),
            "int6_asym_g256_bf16": IntxTensor.from_float(weight(46, 8, 256, BF16), 6, 256, symmetric=False),
            "int7_sym_g32_f32": IntxTensor.from_float(weight(47, 8, 64, F32), 7, 32),
            "int8_asym_row_bf16": IntxTensor.from_float(weight(48, 8, 64, BF16), 8, None, symmetric=False),
            # int8 per-token activations (Int8DynamicActivationIntxWeightConfig, scheme int8-int3).
            "int3_sym_g32_dyn_bf16": IntxTensor.from_float(weight(49, 16, 64, BF16), 3, 32, act_quant="per_token"),
            "int2_asym_row_dyn_f32": IntxTensor.from_float(weight(50, 8, 64, F32), 2, None, symmetric=False,
                                                           act_quant="per_token"),
            "bias": torch.linspace(-1, 1, 16, dtype=BF16),
        },
    }


def state_dicts_act_variants() -> dict[str, dict[str, torch.Tensor]]:
    int4_act = functools.partial(Int4Tensor.from_float, qparams="minmax", act_quant="per_token")
    static = functools.partial(Float8Tensor.from_float, act_quant="static")
    return {
        "v1_int4_act": {
            # The schemes int8-int4 (g32), int4-int4 and fp8-int4 (g128), as their configs make them.
            "int8_act_sym_g32_bf16": int4_act(weight(36, 32, 128, BF16), 32, True, act_dtype=torch.int8),
            "int4_act_sym_g128_bf16": int4_act(weight(37, 16, 256, BF16), 128, True, act_dtype=torch.int4),
            "e4m3_act_sym_g128_bf16": int4_act(weight(38, 16, 256, BF16), 128, True, act_dtype=E4M3),
            # Asymmetric weights with a partial last group (96 = 64 + 32), e5m2 activations, fp16.
            "int8_act_asym_k96_g64_f16": int4_act(weight(39, 16, 96, F16), 64, False, act_dtype=torch.int8),
            "e5m2_act_asym_g32_f16": int4_act(weight(40, 16, 64, F16), 32, False, act_dtype=E5M2),
        },
        "v1_float8_static": {
            "static_e4m3_per_tensor_bf16": static(weight(41, 16, 64, BF16), E4M3, PerTensor(), act_dtype=E4M3,
                                                  act_scale=2.0**-7),
            "static_e4m3_per_row_e5m2_acts_f16": static(weight(42, 16, 64, F16), E4M3, PerRow(), act_dtype=E5M2,
                                                        act_scale=2.0**-5),
            # A scale so small that the inputs clip at the float8 maximum.
            "static_e4m3_clipping_bf16": static(weight(43, 16, 64, BF16), E4M3, PerTensor(), act_scale=2.0**-10),
        },
    }


def state_dicts_intx_asym_act() -> dict[str, dict[str, torch.Tensor]]:
    asym = functools.partial(IntxTensor.from_float, act_quant="per_token_asymmetric")
    return {
        "v1_intx_asym_act": {
            # Int8DynamicActivationIntxWeightConfig(act_mapping_type="asymmetric"), as
            # convert-torchao makes it from torchao's int8_asym_per_token weights.
            "int4_asym_g32_bf16": asym(weight(51, 16, 64, BF16), 4, 32, symmetric=False),
            "int3_sym_row_f16": asym(weight(52, 8, 80, F16), 3, None),
        },
    }


def state_dicts_nvfp4() -> dict[str, dict[str, torch.Tensor]]:
    def pow2_scale(w: torch.Tensor) -> torch.Tensor:
        # amax 2688 * 2^-12: the per-tensor scale is exactly 2^-12 and every decoded value has few
        # bits, so the stored float64 answers are exact (check_exact).
        w = w.clone()
        w.view(-1)[0] = 2688 * 2.0 ** -12
        return w

    experts = torch.stack([pow2_scale(weight(60 + e, 8, 48, BF16)) for e in range(3)]) * torch.tensor(
        [1.0, 0.25, 4.0], dtype=BF16)[:, None, None]
    special = torch.cat([torch.zeros(1, 32), torch.full((1, 32), -0.0), weight(64, 4, 32, F32) * 1e-6,
                         weight(65, 4, 32, F32)]).to(F32)
    special[-1, 0] = 2688 * 2.0 ** -8
    return {
        "v1_nvfp4": {
            # Weight-only (nvfp4-wo) at SmolLM2's hidden size (36 blocks), a partial last block of 8
            # (K = 72 = 4 x 16 + 8), fp16; the nvfp4 scheme's dynamic NVFP4 activations.
            "wo_k576_bf16": NVFP4Tensor.from_float(pow2_scale(weight(56, 16, 576, BF16))),
            "wo_k72_f16": NVFP4Tensor.from_float(pow2_scale(weight(57, 8, 72, F16))),
            "dyn_k64_bf16": NVFP4Tensor.from_float(pow2_scale(weight(58, 16, 64, BF16)), "nvfp4"),
            # Fused experts [E, N, K]: a per-tensor scale per expert, experts of different ranges.
            "experts_e3_k48_bf16": NVFP4Tensor.from_float(experts, "nvfp4"),
            # Zero blocks of both signs, tiny blocks whose scale clamps at 2^-6, an ordinary block.
            "special_f32": NVFP4Tensor.from_float(special),
        },
    }


def state_dicts_fpx() -> dict[str, dict[str, torch.Tensor]]:
    # An all-zero row, a row of float16's tiniest scale (2^-24), -0 and a negative that rounds to -0.
    special = torch.cat([torch.zeros(1, 40), torch.full((1, 40), 1e-7), weight(56, 6, 40, F32)])
    special[2, :3] = torch.tensor([-0.0, -1e-9, 3.0])
    return {
        "v1_fpx": {
            # Every format; rows of K not a multiple of 8 codes (K = 13, 67: a partial last byte).
            "e3m2_k576_bf16": FPxTensor.from_float(weight(53, 16, 576, BF16), 3, 2),
            "e2m3_k67_f32": FPxTensor.from_float(weight(54, 8, 67, F32), 2, 3),
            "e2m2_k64_f16": FPxTensor.from_float(weight(55, 8, 64, F16), 2, 2),
            "e3m1_k13_bf16": FPxTensor.from_float(weight(57, 8, 13, BF16), 3, 1),
            "e3m0_k80_bf16": FPxTensor.from_float(weight(58, 8, 80, BF16), 3, 0),
            "e2m1_k96_f32": FPxTensor.from_float(weight(59, 8, 96, F32), 2, 1),
            "e3m2_special_f16": FPxTensor.from_float(special.to(F16), 3, 2),
            "bias": torch.linspace(-1, 1, 16, dtype=BF16),
        },
    }


def state_dicts_fpx3d() -> dict[str, dict[str, torch.Tensor]]:
    ranges = torch.tensor([1.0, 8.0, 0.125])[:, None, None]  # experts of different ranges: a scale each row
    return {
        "v1_fpx3d": {
            # Fused experts [E, N, K]: the fp6 scheme (e3m2), and rows ending inside a byte (K = 13, 20).
            "e3m2_experts_bf16": FPxTensor.from_float(experts_weight(65, 3, 8, 40, F32).mul(ranges).to(BF16), 3, 2),
            "e2m2_experts_k13_f32": FPxTensor.from_float(experts_weight(66, 2, 4, 13, F32), 2, 2),
            "e2m1_experts_k20_f16": FPxTensor.from_float(experts_weight(67, 2, 4, 20, F16), 2, 1),
            "experts_bias": torch.linspace(-1, 1, 24, dtype=BF16).reshape(3, 8),
        },
    }


def state_dicts_fp8_sparse() -> dict[str, dict[str, torch.Tensor]]:
    sparse = Float8SemiSparseTensor.from_float
    ties = (torch.randint(-3, 4, (7, 32), generator=torch.Generator().manual_seed(64)).float() / 4)
    return {
        "v1_fp8_sparse": {
            # The scheme fp8-sparse (e4m3 per-token activations) and the config's default (e5m2).
            "dyn_e4m3_k64_bf16": sparse(weight(60, 16, 64, BF16), act_dtype=E4M3),
            "dyn_e5m2_k576_bf16": sparse(weight(61, 16, 576, BF16), act_dtype=E5M2),
            # An odd number of groups (36 = 9 x 4: the last position byte pads a nibble); act_dtype absent.
            "dyn_k36_bf16": sparse(weight(62, 8, 36, BF16)),
            "weight_only_k64_f16": sparse(weight(63, 8, 64, F16), act_quant=None),
            # Ties (equal magnitudes: the lower position wins), zeros, and an all-zero row.
            "ties_zeros_f32": sparse(torch.cat([torch.zeros(1, 32), ties]), act_quant=None),
            "bias": torch.linspace(-1, 1, 16, dtype=BF16),
        },
    }


def state_dicts_awq_input_scale() -> dict[str, dict[str, torch.Tensor]]:
    from hf_aoq.tensors.common import with_input_scale

    def scaled(t, seed: int, k: int, quantize):
        # Powers of two, so that x / s and Wq / s are exact and N.linear stays exact in float64.
        g = torch.Generator().manual_seed(seed)
        s = 2.0 ** torch.randint(-2, 3, (k,), generator=g).float()
        return with_input_scale(quantize((t.float() * s).to(t.dtype)), s)

    return {
        "v1_awq_input_scale": {
            "int4_asym_g32_bf16": scaled(weight(61, 16, 128, BF16), 62, 128,
                                         lambda w: Int4Tensor.from_float(w, 32, qparams="minmax")),
            "int4_sym_g64_partial_f16": scaled(weight(63, 8, 96, F16), 64, 96,
                                               lambda w: Int4Tensor.from_float(w, 64, symmetric=True, qparams="minmax")),
            "int4dq_g32_bf16": scaled(weight(65, 16, 128, BF16), 66, 128, lambda w: Int4DQTensor.from_float(w, 32)),
        },
    }


def state_dicts_intxdq() -> dict[str, dict[str, torch.Tensor]]:
    return {
        "v1_intxdq": {
            "int3_g32_k576_bf16": IntxDQTensor.from_float(weight(70, 16, 576, BF16), 3, 32),
            # Partial last groups (80 = 2 x 32 + 16; 96 = 64 + 32) and an odd K (45 x 3 bits).
            "int3_g32_k80_f32": IntxDQTensor.from_float(weight(71, 32, 80, F32), 3, 32),
            "int2_g64_k96_f16": IntxDQTensor.from_float(weight(72, 8, 96, F16), 2, 64),
            "int3_g32_k45_f32": IntxDQTensor.from_float(weight(73, 8, 45, F32), 3, 32),
            # An all-zero row and a constant one: the codes for zero.
            "int2_g32_k64_special_bf16": IntxDQTensor.from_float(
                torch.cat([torch.zeros(1, 64), torch.full((1, 64), 0.5), weight(74, 14, 64, F32)]).to(BF16), 2, 32),
            # Fused experts [E, N, K]: T_d and T_c per expert.
            "experts_int3_g32_bf16": IntxDQTensor.from_float(experts_weight(75, 3, 8, 64, BF16), 3, 32),
        },
    }


GENERATIONS = {
    "manifest.json": state_dicts_v1,
    "manifest.partial_groups.json": state_dicts_partial_groups,
    "manifest.int4dq.json": state_dicts_int4dq,
    "manifest.mx.json": state_dicts_mx,
    "manifest.intx.json": state_dicts_intx,
    "manifest.act_variants.json": state_dicts_act_variants,
    "manifest.intx_asym_act.json": state_dicts_intx_asym_act,
    "manifest.mx3d.json": state_dicts_mx3d,
    "manifest.nvfp4.json": state_dicts_nvfp4,
    "manifest.fpx.json": state_dicts_fpx,
    "manifest.fpx3d.json": state_dicts_fpx3d,
    "manifest.fp8_sparse.json": state_dicts_fp8_sparse,
    "manifest.awq_input_scale.json": state_dicts_awq_input_scale,
    "manifest.intxdq.json": state_dicts_intxdq,
}


def reference_linear_f64(w, x: torch.Tensor) -> torch.Tensor:
    """The reference kernel's answer in float64: inputs quantized as the kernels do, then an
    exact matmul (see `check_exact`); for 3-D experts, each expert's, stacked."""
    if len(w.shape) == 3:
        return torch.stack([reference_linear_f64(w[e], x) for e in range(w.shape[0])])
    return w.simulate_input_quantization(x).double() @ w.dequantize().double().t()


def check_exact(w, x: torch.Tensor, name: str) -> None:
    """Refuse inputs whose float64 matmul could depend on the summation order: every product
    must be exact and every partial sum a multiple of 2^-L below 2^(53-L)."""
    if len(w.shape) == 3:
        for e in range(w.shape[0]):
            check_exact(w[e], x, f"{name} (expert {e})")
        return
    a = w.simulate_input_quantization(x).double().tolist()
    b = w.dequantize().double().reshape(-1, w.shape[-1]).tolist()  # every expert's rows for 3-D
    for row in a:
        for col in b:
            products = [Fraction(p) * Fraction(q) for p, q in zip(row, col)]
            if any(Fraction(float(p)) != p for p in products):
                raise SystemExit(f"{name}: a float64 product is inexact; pick an input with fewer bits")
            lsb = max(p.denominator for p in products)
            if sum(abs(p) for p in products) * lsb >= 2**53:
                raise SystemExit(f"{name}: a float64 sum could round; pick an input with fewer bits")


def describe(t) -> dict:
    """A quantized tensor's type and attributes in plain JSON (dtypes by registry name)."""

    def plain(v):
        if isinstance(v, torch.dtype):
            return registry.dtype_name(v)
        if isinstance(v, tuple):
            return list(v)
        return v

    fields = {n: [registry.dtype_name(f.dtype), list(f.shape)] for n, f in t.tensor_fields().items()}
    return {
        "type": type(t).__name__,
        "schema_version": type(t).schema_version,
        "fields": fields,
        "attributes": {n: plain(v) for n, v in t.attributes().items()},
    }


LIST_OF_SCALARS = r"\[\s*((?:[^\[\]{}]|\[[^\[\]{}\n]*\])*?)\s*\]"  # may hold one-line lists


def compact_lists(text: str) -> str:
    """Put each JSON list of scalars (and lists of those) on one line."""
    while True:
        shorter = re.sub(LIST_OF_SCALARS, lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
        if shorter == text:
            return text
        text = shorter


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def write_generation(out: str, manifest_name: str, state_dicts: dict[str, dict[str, torch.Tensor]]) -> None:
    manifest = {
        "about": "Written once by scripts/make_fixtures.py. Never regenerate; see docs/format.md.",
        "hf_aoq_version": hf_aoq.__version__,
        "format_version": serialization.FORMAT_VERSION,
        "torch_version": torch.__version__.split("+")[0],
        "files": {},
    }
    for seed, (stem, sd) in enumerate(state_dicts.items()):
        path = os.path.join(out, stem + ".safetensors")
        expected_path = os.path.join(out, stem + ".expected.safetensors")
        if os.path.exists(path) or os.path.exists(expected_path):
            raise SystemExit(f"{path} already exists; fixtures are never overwritten")
        expected, quantized, plain = {}, {}, []
        for i, (name, t) in enumerate(sd.items()):
            if isinstance(t, hf_aoq.AOQTensor):
                x = fixture_input(1000 * seed + i, t.shape[-1], t.dtype)
                check_exact(t, x, f"{stem}/{name}")
                expected[f"{name}.input"] = x
                expected[f"{name}.dequantized"] = t.dequantize()
                expected[f"{name}.linear"] = reference_linear_f64(t, x)
                quantized[name] = describe(t)
            else:
                expected[name] = t
                plain.append(name)
        serialization.save_file(sd, path)
        safetensors.torch.save_file(expected, expected_path, metadata={"format": "pt"})

        loaded = serialization.load_file(path)  # a fixture that does not round-trip is useless
        for name, t in sd.items():
            got = loaded[name]
            if isinstance(t, hf_aoq.AOQTensor):
                assert torch.equal(got.dequantize(), expected[f"{name}.dequantized"]), name
                linear = reference_linear_f64(got, expected[f"{name}.input"])
                assert torch.equal(linear, expected[f"{name}.linear"]), name
            else:
                assert torch.equal(got, t), name

        manifest["files"][stem + ".safetensors"] = {
            "sha256": sha256(path),
            "expected": stem + ".expected.safetensors",
            "expected_sha256": sha256(expected_path),
            "quantized": quantized,
            "plain": plain,
        }
    with open(os.path.join(out, manifest_name), "w") as f:
        f.write(compact_lists(json.dumps(manifest, indent=1)) + "\n")
    print(f"{manifest_name}: wrote {len(manifest['files'])} fixtures and their expected outputs to {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=FIXTURES, help="output folder (default tests/fixtures)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for manifest_name, state_dicts in GENERATIONS.items():
        if os.path.exists(os.path.join(args.out, manifest_name)):
            print(f"{manifest_name}: already written, kept as it is (fixtures are never regenerated)")
            continue
        write_generation(args.out, manifest_name, state_dicts())
    total = sum(os.path.getsize(os.path.join(args.out, n)) for n in os.listdir(args.out))
    print(f"{args.out} holds {total / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
