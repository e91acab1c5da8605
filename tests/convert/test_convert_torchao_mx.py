"""`hf-aoq convert-torchao` for torchao's MXTensor (torchao.prototype.mx_formats): MXFP8 and MXFP4
weights (2-D, and 3-D experts) become hf_aoq MXTensor with the same codes and e8m0 scale bytes, and
decode to torchao's values (element * 2^(code - 127) in orig_dtype, written in this file).

torchao is not installed, so the MX checkpoints are built from torchao's published layout (its
MXTensor fields and attributes, and the JSON its safetensors support writes) on top of a fixture
real torchao wrote (tests/fixtures/torchao/int8_weight_only): its linear weights are replaced by
MXTensor entries made of random codes and scales."""
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import hf_aoq
from hf_aoq.convert import convert_torchao_checkpoint
from hf_aoq.convert.torchao import TorchaoConversionError
from hf_aoq.convert.torchao_format import Record
from hf_aoq.convert.torchao_mx import mx_tensor
from hf_aoq.tensors import MXTensor

FIXTURE = Path(__file__).parents[1] / "fixtures" / "torchao" / "int8_weight_only"
FP4 = torch.float4_e2m1fn_x2
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def dtype_json(name):
    return {"_type": "torch.dtype", "_data": name}


def mx_entry(elem: str, act: str | None = None, *, block=32, extra=None, act_extra=None):
    """torchao's metadata for an MXTensor (TensorSubclassAttributeJSONEncoder's form)."""
    data = {"elem_dtype": dtype_json(elem), "block_size": block, "orig_dtype": dtype_json("bfloat16"),
            "kernel_preference": {"_type": "KernelPreference", "_data": "EMULATED"},
            "act_quant_kwargs": None, "is_swizzled_scales": False}
    if act is not None:
        data["act_quant_kwargs"] = {"_type": "QuantizeTensorToMXKwargs", "_data": {
            "elem_dtype": dtype_json(act), "block_size": 32,
            "scaling_mode": {"_type": "ScaleCalculationMode", "_data": "FLOOR"},
            "kernel_preference": {"_type": "KernelPreference", "_data": "EMULATED"},
            "is_swizzled_scales": False, **(act_extra or {})}}
    data.update(extra or {})
    return {"_type": "MXTensor", "_data": data, "_tensor_data_names": ["qdata", "scale"]}


def mx_fields(shape, elem: str, seed: int):
    """Random torchao MX fields for a weight of `shape` [..., N, K]: finite e4m3/e5m2 codes (or
    any e2m1 bytes) and scale codes near 2^-6."""
    g = torch.Generator().manual_seed(seed)
    *lead, k = shape
    if elem == "float4_e2m1fn_x2":
        qdata = torch.randint(0, 256, (*lead, k // 2), generator=g, dtype=torch.uint8)
    else:
        dt = getattr(torch, elem)
        qdata = (torch.randn(*lead, k, generator=g) * 8).clamp(-200, 200).to(dt)
    scale = torch.randint(118, 124, (*lead, k // 32), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return qdata, scale


def torchao_dequantize(qdata, scale, fp4: bool, dtype=torch.bfloat16):
    """torchao's to_dtype: unpack (low nibble first), decode, times 2^(e - 127), in orig_dtype."""
    if fp4:
        q = qdata.view(torch.uint8)
        values = torch.tensor(E2M1)[torch.stack([q & 15, q >> 4], -1).reshape(*q.shape[:-1], -1).long()]
    else:
        values = qdata.float()
    s = torch.pow(2.0, scale.view(torch.uint8).to(torch.float32) - 127)
    return (values.to(dtype).reshape(*values.shape[:-1], -1, 32) * s.to(dtype).unsqueeze(-1)).reshape(values.shape)


def mx_checkpoint(tmp_path, elem="float4_e2m1fn_x2", act=None, *, edit=None, tensors_edit=None):
    """The fixture with every linear weight made a torchao MXTensor; returns (folder, fields)."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURE, src)
    path = src / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    data = load_file(path)
    fields = {}
    for i, name in enumerate(json.loads(meta["tensor_names"])):
        if json.loads(meta[name])["_type"] == "Tensor":
            continue
        module, leaf = name.rsplit(".", 1)
        prefix = f"{module}._{leaf}_"
        shape = tuple(data[prefix + "qdata"].shape)
        for key in [k for k in data if k.startswith(prefix)]:
            del data[key]
        data[prefix + "qdata"], data[prefix + "scale"] = fields[name] = mx_fields(shape, elem, i)
        entry = mx_entry(elem, act)
        if edit:
            edit(name, entry)
        meta[name] = json.dumps(entry)
    if tensors_edit:
        tensors_edit(data)
    save_file(data, str(path), metadata=meta)
    return src, fields


def load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.mark.parametrize("elem, act, detail", [
    ("float4_e2m1fn_x2", None, "float4_e2m1fn_x2, e8m0 scale per 32, weight-only"),
    ("float8_e4m3fn", "float8_e4m3fn", "float8_e4m3fn, e8m0 scale per 32, dynamic float8_e4m3fn activations in "
                                       "blocks of 32"),
    ("float4_e2m1fn_x2", "float4_e2m1fn_x2", "float4_e2m1fn_x2, e8m0 scale per 32, dynamic float4_e2m1fn_x2 "
                                             "activations in blocks of 32"),
    ("float8_e5m2", None, "float8_e5m2, e8m0 scale per 32, weight-only"),
])
def test_torchao_mx_weights_convert_bit_exactly(tmp_path, elem, act, detail):
    src, fields = mx_checkpoint(tmp_path, elem, act)
    summary = convert_torchao_checkpoint(src, tmp_path / "out")
    assert {(t.torchao_type, t.aoq_type, t.detail) for t in summary.tensors} == {("MXTensor", "MXTensor", detail)}
    assert len(summary.tensors) == 14
    model = load(tmp_path / "out")
    elem_dtype = getattr(torch, elem)
    act_dtype = None if act is None else getattr(torch, act)
    for name, (qdata, scale) in fields.items():
        w = model.get_parameter(name)
        assert isinstance(w, MXTensor) and w.elem_dtype == elem_dtype and w.act_dtype == act_dtype
        assert w.dtype == torch.bfloat16 and w.shape == (qdata.shape[0], qdata.shape[1] * (2 if elem_dtype == FP4 else 1))
        assert torch.equal(w.qdata.view(torch.uint8), qdata.view(torch.uint8))  # the same bytes
        assert torch.equal(w.scale, scale.view(torch.uint8))
        want = torchao_dequantize(qdata, scale, elem_dtype == FP4)
        assert torch.equal(w.dequantize().view(torch.int16), want.view(torch.int16))
    recipe = json.dumps(json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"])
    assert "MXFPInferenceConfig" in recipe
    x = torch.randn(3, model.config.hidden_size).to(torch.bfloat16)
    name = "model.layers.0.self_attn.q_proj.weight"
    w = model.get_parameter(name)
    ref = F.linear(w.simulate_input_quantization(x), torchao_dequantize(*fields[name], elem_dtype == FP4))
    torch.testing.assert_close(F.linear(x, w), ref, rtol=2e-2, atol=2e-2)


def test_3d_experts_and_float4_typed_qdata_convert():
    """A 3-D [E, N, K] MXTensor (torchao's MoE weights), qdata stored as float4_e2m1fn_x2."""
    qdata, scale = mx_fields((4, 16, 128), "float4_e2m1fn_x2", 0)
    entry = mx_entry("float4_e2m1fn_x2")
    from hf_aoq.convert.torchao_format import _decode

    attrs = {a: _decode(v) for a, v in entry["_data"].items()}
    r = Record("<test>", "experts.w", "MXTensor", {"qdata": qdata.view(FP4), "scale": scale}, attrs)
    t, config, _, want = mx_tensor(r)
    assert t.shape == (4, 16, 128) and t.block_size == (1, 1, 32)
    MXTensor.check_fields(t.fields())
    assert torch.equal(t.dequantize(), want) and torch.equal(want, torchao_dequantize(qdata, scale, True))
    assert config == hf_aoq.MXFPInferenceConfig(activation_dtype=None, weight_dtype=FP4)


W = "model.layers.1.mlp.up_proj.weight"
WK = "model.layers.1.mlp.up_proj._weight_"


def only(name, fn):
    return lambda n, e: fn(e) if n == name else None


@pytest.mark.parametrize("edit, words", [
    (lambda e: e["_data"].update(block_size=16), ["block_size 16", "blocks of 32"]),
    (lambda e: e["_data"].update(elem_dtype="fp6_e2m3"), ["elem_dtype", "fp6"]),
    (lambda e: e["_data"].update(is_swizzled_scales=True), ["swizzled scales"]),
    (lambda e: e["_data"].update(swizzle_type={"_type": "Swizzle_32_4_4", "_data": {}}), ["swizzled scales"]),
    (lambda e: e["_data"].update(orig_dtype=dtype_json("float8_e4m3fn")), ["orig_dtype"]),
    (lambda e: e["_data"].update(mystery=1), ["unknown attribute 'mystery'"]),
])
def test_what_hf_aoq_cannot_hold_is_refused_naming_the_tensor(tmp_path, edit, words):
    src, _ = mx_checkpoint(tmp_path, edit=only(W, edit))
    with pytest.raises(TorchaoConversionError) as e:
        convert_torchao_checkpoint(src, tmp_path / "out")
    for w in [repr(W)] + words:
        assert w in str(e.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("act_extra, words", [
    ({"scaling_mode": {"_type": "ScaleCalculationMode", "_data": "RCEIL"}}, ["scaling_mode", "RCEIL", "FLOOR"]),
    ({"block_size": 16}, ["act_quant_kwargs.block_size 16"]),
    ({"is_swizzled_scales": True}, ["act_quant_kwargs: swizzled scales"]),
])
def test_activation_quantization_hf_aoq_does_not_do_is_refused(tmp_path, act_extra, words):
    def edit(name, entry):
        if name == W:
            entry["_data"]["act_quant_kwargs"]["_data"].update(act_extra)

    src, _ = mx_checkpoint(tmp_path, "float8_e4m3fn", "float8_e4m3fn", edit=edit)
    with pytest.raises(TorchaoConversionError) as e:
        convert_torchao_checkpoint(src, tmp_path / "out")
    for w in [repr(W)] + words:
        assert w in str(e.value)


@pytest.mark.parametrize("change, words", [
    (lambda d: d.update({WK + "scale": d[WK + "scale"][:, :1].contiguous()}), ["field 'scale' has shape"]),
    (lambda d: d.update({WK + "scale": d[WK + "scale"].view(torch.uint8).to(torch.int16)}),
     ["field 'scale' has dtype torch.int16"]),
    (lambda d: d.update({WK + "qdata": d[WK + "qdata"].to(torch.int16)}), ["field 'qdata' has dtype torch.int16"]),
    (lambda d: d[WK + "scale"].view(torch.uint8).__setitem__((0, 0), 255), ["e8m0 code 255"]),
])
def test_malformed_fields_are_refused(tmp_path, change, words):
    src, _ = mx_checkpoint(tmp_path, tensors_edit=change)
    with pytest.raises(TorchaoConversionError) as e:
        convert_torchao_checkpoint(src, tmp_path / "out")
    for w in [repr(W)] + words:
        assert w in str(e.value)
