"""Activation-quantized int4 (Int4Tensor with act_quant/act_dtype: int8, int4 or float8 per
token) and static float8 (Float8Tensor with act_scale): configs, numerics against the
definitions, bad input, quantize_ / FqnToConfig, save and reload bit-exact, torch.compile,
dequantize, inspect and the scheme names."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_aoq import (
    AOQBaseConfig,
    AOQError,
    Float8DynamicActivationInt4WeightConfig,
    Float8StaticActivationFloat8WeightConfig,
    Float8Tensor,
    FormatError,
    FqnToConfig,
    Int4DynamicActivationInt4WeightConfig,
    Int4Tensor,
    Int8DynamicActivationInt4WeightConfig,
    PerRow,
    quantize_,
)
from hf_aoq import serialization as S
from hf_aoq.configs import SCHEMES, config_for_scheme
from hf_aoq.kernels import select_kernel
from hf_aoq.kernels.reference import reference_linear

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

INT4_ACT_CONFIGS = [
    Int8DynamicActivationInt4WeightConfig(),
    Int8DynamicActivationInt4WeightConfig(group_size=64, mapping_type="asymmetric"),
    Int4DynamicActivationInt4WeightConfig(),
    Float8DynamicActivationInt4WeightConfig(),
    Float8DynamicActivationInt4WeightConfig(group_size=32, activation_dtype=E5M2),
]
ALL_CONFIGS = INT4_ACT_CONFIGS + [
    Float8StaticActivationFloat8WeightConfig(scale=0.01),
    Float8StaticActivationFloat8WeightConfig(scale=0.5, activation_dtype=E5M2, granularity=PerRow()),
]


def canonical(t):
    return t.to_canonical() if hasattr(t, "to_canonical") else t


def weight(n=64, k=256, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.05).to(dtype)


def test_config_defaults_follow_torchao_and_round_trip_json():
    c = Int8DynamicActivationInt4WeightConfig()
    assert (c.group_size, c.mapping_type) == (32, "symmetric")
    assert Float8StaticActivationFloat8WeightConfig().scale is None
    # torchao passes its static scale as a one-element tensor: kept as its number.
    assert Float8StaticActivationFloat8WeightConfig(scale=torch.tensor([0.25])).scale == 0.25
    for config in ALL_CONFIGS:
        assert AOQBaseConfig.from_dict(config.to_dict()) == config
    # A JSON integer is a valid scale.
    data = {"type": "Float8StaticActivationFloat8WeightConfig", "scale": 2}
    assert AOQBaseConfig.from_dict(data).scale == 2.0


@pytest.mark.parametrize("make, match", [
    (lambda: Int8DynamicActivationInt4WeightConfig(group_size=48), r"group_size must be one of \(32, 64, 128, 256\)"),
    (lambda: Int4DynamicActivationInt4WeightConfig(group_size=16), r"Int4DynamicActivationInt4WeightConfig.group_size"),
    (lambda: Int8DynamicActivationInt4WeightConfig(mapping_type="affine"), r"mapping_type must be one of"),
    (lambda: Float8DynamicActivationInt4WeightConfig(activation_dtype=torch.int8), r"activation_dtype must be one of"),
    (lambda: Float8DynamicActivationInt4WeightConfig(group_size=100), r"group_size must be one of"),
    (lambda: Float8StaticActivationFloat8WeightConfig(scale=0.0), r"scale: .*positive finite"),
    (lambda: Float8StaticActivationFloat8WeightConfig(scale=torch.ones(2)), r"scale: .*one number"),
    (lambda: Float8StaticActivationFloat8WeightConfig(activation_dtype=torch.bfloat16), r"activation_dtype must be"),
])
def test_bad_configs_name_the_field_and_the_allowed_values(make, match):
    with pytest.raises(AOQError, match=match):
        make()


def test_json_refuses_a_bad_scale():
    with pytest.raises(FormatError, match="scale"):
        AOQBaseConfig.from_dict({"type": "Float8StaticActivationFloat8WeightConfig", "scale": -1.0})
    with pytest.raises(FormatError, match="scale"):
        AOQBaseConfig.from_dict({"type": "Float8StaticActivationFloat8WeightConfig", "scale": "0.1"})


def test_missing_static_scale_is_an_error_naming_the_field():
    with pytest.raises(AOQError, match=r"Float8StaticActivationFloat8WeightConfig.scale is None.*calibrat"):
        Float8StaticActivationFloat8WeightConfig().quantize_weight(weight(), name="layer.weight")
    from hf_aoq import AOQConfig

    with pytest.raises(AOQError, match="scale is None and there is no calibration"):
        AOQConfig(FqnToConfig({"_default": Float8StaticActivationFloat8WeightConfig()}))
    AOQConfig(Float8StaticActivationFloat8WeightConfig(), calibration="text.txt")  # calibration chooses it


@pytest.mark.parametrize("act_dtype, qmax", [(torch.int8, 127), (torch.int4, 7)])
def test_integer_activations_are_per_token_symmetric(act_dtype, qmax):
    w = Int4Tensor.from_float(weight(), 32, True, act_quant="per_token", act_dtype=act_dtype)
    x = torch.randn(5, 256) * torch.arange(1, 6)[:, None]
    codes, scale = w.quantize_input(x)
    assert codes.dtype == torch.int8 and scale.shape == (5, 1)
    torch.testing.assert_close(scale, x.abs().amax(1, keepdim=True) / qmax)
    assert torch.equal(codes, torch.round(x / scale).clamp(-qmax, qmax).to(torch.int8))
    assert int(codes.abs().max()) == qmax
    # The reference: the fake-quantized input against the dequantized weight.
    expected = F.linear((codes.float() * scale), w.dequantize(torch.float32))
    torch.testing.assert_close(reference_linear(x, w, None), expected)


def test_float8_activations_are_per_token():
    w = Int4Tensor.from_float(weight(), 128, True, act_quant="per_token", act_dtype=E4M3)
    x = torch.randn(3, 256)
    codes, scale = w.quantize_input(x)
    assert codes.dtype == E4M3
    torch.testing.assert_close(scale, x.abs().amax(1, keepdim=True) / 448)
    assert not torch.equal(w.simulate_input_quantization(x), x)


def test_static_float8_uses_the_given_scale_and_clips():
    w = Float8Tensor.from_float(weight(k=64), E4M3, act_quant="static", act_scale=2.0**-6)
    assert w.act_scale.dtype == torch.float32 and w.act_scale.shape == (1, 1)
    x = torch.tensor([[1.0, -20.0] + [0.0] * 62])
    codes, scale = w.quantize_input(x)
    assert float(scale) == 2.0**-6
    assert float(codes[0, 0].float()) == 64.0 and float(codes[0, 1].float()) == -448.0  # clipped
    with pytest.raises(AOQError, match="'static' needs an act_scale"):
        Float8Tensor.from_float(weight(k=64), E4M3, act_quant="static")
    with pytest.raises(AOQError, match="'static' needs an act_scale"):
        Float8Tensor.from_float(weight(k=64), E4M3, act_quant="per_row", act_scale=0.1)


def test_loader_refuses_inconsistent_activation_fields():
    int4 = Int4Tensor.from_float(weight(), 32, act_quant="per_token", act_dtype=torch.int8).fields()
    for bad, match in (({"act_dtype": None}, "act_dtype"), ({"act_quant": None}, "act_dtype"),
                       ({"act_dtype": torch.bfloat16}, "act_dtype' must be one of"),
                       ({"act_quant": "per_row"}, "act_quant' must be one of")):
        with pytest.raises(AOQError, match=match):
            Int4Tensor.check_fields({**int4, **bad})
    f8 = Float8Tensor.from_float(weight(k=64), E4M3, act_quant="static", act_scale=0.5).fields()
    for bad, match in (({"act_scale": None}, "needs the static activation scale"),
                       ({"act_quant": "per_row"}, "only act_quant 'static' takes it"),
                       ({"act_scale": torch.zeros(1, 1)}, "positive and finite"),
                       ({"act_scale": torch.ones(2, 1)}, r"float32 \[1, 1\]")):
        with pytest.raises(AOQError, match=match):
            Float8Tensor.check_fields({**f8, **bad})


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=lambda c: f"{type(c).__name__}-{c.to_dict()}")
def test_quantize_save_reload_compile_and_dequantize(config, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 32)).to(torch.bfloat16)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        float_out = model(x)
    quantize_(model, FqnToConfig({"_default": config, "2": None}))
    w = model[0].weight
    assert isinstance(w, (Int4Tensor, Float8Tensor)) and not isinstance(model[2].weight, (Int4Tensor, Float8Tensor))
    with torch.no_grad():
        eager = model(x)
        reference = F.relu(reference_linear(x, w, model[0].bias))
        torch.testing.assert_close(eager[:, :0], reference[:, :0])
        torch.testing.assert_close(F.relu(F.linear(x, w, model[0].bias)), reference, atol=0.05, rtol=0.02)
        assert (eager.float() - float_out.float()).abs().max() < 0.2 * float_out.float().abs().max()
    # Save and reload: the same canonical fields and attributes, bit for bit, and the same outputs.
    S.save_file({"w": w}, tmp_path / "w.safetensors")
    again = S.load_file(tmp_path / "w.safetensors")["w"]
    a, b = canonical(again), canonical(w)
    assert a.attributes() == b.attributes()
    assert a.tensor_fields().keys() == b.tensor_fields().keys()
    for name, t in b.tensor_fields().items():
        assert torch.equal(a.tensor_fields()[name], t), name
    assert torch.equal(again.dequantize(), w.dequantize())
    with torch.no_grad():
        torch.testing.assert_close(F.linear(x, again), F.linear(x, w), atol=0, rtol=0)
        torch._dynamo.reset()  # each config is a new graph: leave no recompiles counted against later tests
        try:
            compiled = torch.compile(model, fullgraph=True)
            torch.testing.assert_close(compiled(x), eager, atol=0.03, rtol=0.02)
        finally:
            torch._dynamo.reset()


def test_scheme_names_build_these_configs():
    assert {"int8-int4", "fp8-int4", "int4-int4", "fp8-static"} <= set(SCHEMES)
    assert config_for_scheme("int8-int4") == Int8DynamicActivationInt4WeightConfig()
    assert config_for_scheme("int8-int4", 128) == Int8DynamicActivationInt4WeightConfig(group_size=128)
    assert config_for_scheme("fp8-int4") == Float8DynamicActivationInt4WeightConfig()
    assert config_for_scheme("int4-int4", 32) == Int4DynamicActivationInt4WeightConfig(group_size=32)
    assert config_for_scheme("fp8-static") == Float8StaticActivationFloat8WeightConfig()
    with pytest.raises(AOQError, match="no group size"):
        config_for_scheme("fp8-static", 32)
    with pytest.raises(AOQError, match="group_size must be one of"):
        config_for_scheme("int8-int4", 48)


def test_inspect_names_the_activation_formats(tmp_path):
    from hf_aoq.checkpoint import read_checkpoint

    sd = {
        "a.weight": Int8DynamicActivationInt4WeightConfig().quantize_weight(weight()),
        "b.weight": Int4DynamicActivationInt4WeightConfig().quantize_weight(weight()),
        "c.weight": Float8DynamicActivationInt4WeightConfig().quantize_weight(weight()),
        "d.weight": Float8StaticActivationFloat8WeightConfig(scale=0.1).quantize_weight(weight()),
    }
    S.save_file(sd, tmp_path / "model.safetensors")
    schemes = {t.name: t.scheme for t in read_checkpoint(tmp_path / "model.safetensors").tensors}
    assert schemes["a.weight"] == "int4 g32 sym dyn-act per_token int8"
    assert schemes["b.weight"] == "int4 g128 sym dyn-act per_token int4"
    assert schemes["c.weight"] == "int4 g128 sym dyn-act per_token e4m3"
    assert schemes["d.weight"] == "fp8 e4m3 per-tensor static-act e4m3"


def test_int_activation_weights_run_the_integer_kernel_where_it_is_built():
    from hf_aoq.kernels import cpu_ext

    x = torch.randn(2, 256)
    for config, name in ((Int8DynamicActivationInt4WeightConfig(), "cpu_int8_int4_ext"),
                         (Int4DynamicActivationInt4WeightConfig(), "cpu_int8_int4_ext"),
                         (Float8DynamicActivationInt4WeightConfig(), "cpu_int4_ext")):
        w = config.quantize_weight(weight(dtype=torch.float32)).place()
        chosen = select_kernel("linear", x, w).name
        assert chosen == (name if cpu_ext.available() else "cpu_int4pack_mm")
