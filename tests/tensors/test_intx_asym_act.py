"""IntxTensor act_quant "per_token_asymmetric": torchao's IntxUnpackedToInt8Tensor
"int8_asym_per_token" activations (a scale and an int8 zero point per token, every step in the
activation's dtype), against a float64 implementation of torchao's formula
(tests/torchao_formulas.py); the config that makes it; save/reload; the C++ rows refusing it so
the reference kernel runs."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_aoq import AOQError, PerGroup, PerRow, quantize_, serialization
from hf_aoq.configs import Int8DynamicActivationIntxWeightConfig, recipe_from_dict, recipe_to_dict
from hf_aoq.kernels import registry
from hf_aoq.tensors.intx import IntxTensor
from torchao_formulas import torchao_int8_asym_per_token64 as torchao_fake_quant64

ASYM = "per_token_asymmetric"


def activations(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 96, generator=gen) * 2
    x[1] = x[1].abs() + 0.5  # all positive: lo = 0, zero point -128
    x[2] = -x[2].abs() - 0.25  # all negative: hi = 0
    x[3] = 0.0  # all zero: scale clamps at eps
    x[4, 7] = 60.0  # an outlier
    x[5] = torch.linspace(-1, 3, 96)  # lopsided range
    x[6, ::3] = 0.0  # exact zeros inside a row
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fake_quant_is_torchaos_formula(dtype):
    w = IntxTensor.from_float(torch.randn(16, 96).to(dtype), 4, 32, act_quant=ASYM)
    x = activations(dtype)
    got = w.simulate_input_quantization(x)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got.double(), torchao_fake_quant64(x))
    # Zero is exactly representable in every row (torchao's preserve_zero), and all-zero rows stay 0.
    assert bool((got[6, ::3] == 0).all()) and bool((got[3] == 0).all())
    # Leading dimensions are tokens too.
    assert torch.equal(w.simulate_input_quantization(x.reshape(2, 4, 96)), got.reshape(2, 4, 96))


def test_asymmetric_is_not_the_symmetric_mode():
    """An all-positive row uses all 256 codes asymmetrically; the symmetric mode wastes half."""
    x = torch.linspace(0.0, 1.0, 96).reshape(1, 96)
    asym = IntxTensor.from_float(torch.randn(16, 96), 4, 32, act_quant=ASYM)
    sym = asym.replace(act_quant="per_token")
    err_asym = (asym.simulate_input_quantization(x) - x).abs().max()
    err_sym = (sym.simulate_input_quantization(x) - x).abs().max()
    assert err_asym < 0.6 * err_sym
    assert torch.equal(asym.simulate_input_quantization(x).double(), torchao_fake_quant64(x))
    with pytest.raises(AOQError, match="per_token_asymmetric"):
        asym.quantize_input(x)


@pytest.mark.parametrize("rows", [1, 5, 80])  # the C++ GEMV's rows, its GEMM's, the AMX row's
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_rows_refuse_it_and_the_reference_kernel_runs(rows, dtype):
    gen = torch.Generator().manual_seed(rows)
    w = IntxTensor.from_float(torch.randn(24, 256, generator=gen).to(dtype), 3, 32, symmetric=False, act_quant=ASYM)
    x = torch.randn(rows, 256, generator=gen).to(dtype)
    rows_ = {k.name: k for k in registry.kernels_for("linear", "IntxTensor")}
    for name in ("cpu_intx_ext", "cpu_intx_bf16_gemm", "cpu_intx_amx", "cpu_intx_avx512bf16"):
        assert not rows_[name].when(x, w), name
    # It is the activation mode that the C++ row refuses: the same weight with symmetric ones fits.
    assert rows_["cpu_intx_ext"].when(x, w.replace(act_quant="per_token"))
    assert registry.select_kernel("linear", x, w).name == "reference"
    bias = torch.randn(24, generator=gen).to(dtype)
    # torchao's linear: the fake-quantized activation times the dequantized weight, plus the bias.
    want = F.linear(torchao_fake_quant64(x).to(dtype), w.dequantize(dtype), bias)
    assert torch.equal(F.linear(x, w, bias), want)


def test_config_field_is_optional_and_round_trips():
    default = Int8DynamicActivationIntxWeightConfig(torch.int4, PerGroup(32))
    asym = Int8DynamicActivationIntxWeightConfig(torch.int4, PerGroup(32), act_mapping_type="asymmetric")
    # Old recipes' JSON is unchanged: the field is written only when set.
    assert "act_mapping_type" not in json.dumps(recipe_to_dict(default))
    assert recipe_to_dict(asym)["act_mapping_type"] == "asymmetric"
    assert recipe_from_dict(recipe_to_dict(asym)) == asym
    assert recipe_from_dict(recipe_to_dict(default)) == default
    w = torch.randn(8, 64)
    assert default.quantize_weight(w).act_quant == "per_token"
    assert asym.quantize_weight(w).act_quant == ASYM
    with pytest.raises(AOQError, match=r"act_mapping_type must be one of \('symmetric', 'asymmetric'\)"):
        Int8DynamicActivationIntxWeightConfig(act_mapping_type="per_token")


def test_quantize_save_and_reload(tmp_path):
    m = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 16)).to(torch.bfloat16)
    quantize_(m, Int8DynamicActivationIntxWeightConfig(torch.int3, PerRow(), "asymmetric",
                                                       act_mapping_type="asymmetric"))
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    y = m(x)
    path = tmp_path / "m.safetensors"
    serialization.save_file(m.state_dict(), str(path))
    sd = serialization.load_file(str(path))
    for name in ("0.weight", "2.weight"):
        a, b = m.state_dict()[name], sd[name]
        assert isinstance(b, IntxTensor) and b.act_quant == ASYM and a.attributes() == b.attributes()
        for f, t in a.tensor_fields().items():
            assert torch.equal(t, getattr(b, f)), f
    m2 = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 16)).to(torch.bfloat16)
    m2.load_state_dict(sd, assign=True)
    assert torch.equal(m2(x), y)


def test_unknown_act_quant_is_refused():
    with pytest.raises(AOQError, match="act_quant must be one of"):
        IntxTensor.from_float(torch.randn(8, 64), 4, 32, act_quant="per_token_asym")
