"""convert-torchao for torchao's NVFP4Tensor, on checkpoints built here from its published layout
(fields qdata / _scale_e4m3 / _per_tensor_scale, cuBLAS's swizzled scale layout, the
QuantizeTensorToNVFP4Kwargs of its dynamic-activation config), written into a copy of a real
torchao checkpoint (tests/fixtures/torchao/int8_weight_only) in place of two of its weights."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import hf_aoq
from hf_aoq.convert import convert_torchao_checkpoint
from hf_aoq.convert.torchao import TorchaoConversionError
from hf_aoq.tensors.nvfp4 import nvfp4_quantize

FIXTURES = Path(__file__).parents[1] / "fixtures" / "torchao"
DYN = "model.layers.1.mlp.up_proj.weight"  # swizzled scales, dynamic NVFP4 activations
WO = "model.layers.0.self_attn.q_proj.weight"  # plain scales, no per-tensor scale, weight-only


def swizzle(scales: torch.Tensor) -> torch.Tensor:
    """cuBLAS's block-scaling-factor layout, written from its description: pad [rows, cols] to
    128 x 4 tiles (zeros), tiles in row-major order, tile element (r, c) at (r % 32) * 16 + (r // 32) * 4 + c."""
    rows, cols = scales.shape
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    padded = torch.zeros(rp, cp, dtype=torch.uint8)
    padded[:rows, :cols] = scales.view(torch.uint8)
    out = torch.empty(rp * cp, dtype=torch.uint8)
    for tr in range(rp // 128):
        for tc in range(cp // 4):
            base = (tr * (cp // 4) + tc) * 512
            for r in range(128):
                for c in range(4):
                    out[base + (r % 32) * 16 + (r // 32) * 4 + c] = padded[tr * 128 + r, tc * 4 + c]
    return out.view(torch.float8_e4m3fn)


def nvfp4_checkpoint(tmp_path, *, edit_dyn=None, edit_wo=None, tensors_edit=None):
    """A copy of the int8_weight_only fixture with DYN and WO rewritten as torchao NVFP4Tensors
    (`edit_*(entry, tensors)` may change an entry first); returns (folder, {name: the hf_aoq
    NVFP4Tensor whose bits were written})."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "int8_weight_only", src)
    path = src / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    data = load_file(path)
    made = {}
    for name, dynamic, edit in ((DYN, True, edit_dyn), (WO, False, edit_wo)):
        module, leaf = name.rsplit(".", 1)
        for key in [k for k in data if k.startswith(f"{module}._{leaf}_")]:
            del data[key]
        w = torch.randn(*weight_shape(src, name), generator=torch.Generator().manual_seed(len(name)))
        if dynamic:  # two-level scales, swizzled, dynamic activations: torchao's inference config
            t = hf_aoq.NVFP4Tensor.from_float(w.to(torch.bfloat16), "nvfp4")
            fields = {"qdata": t.qdata, "_scale_e4m3": swizzle(t.scale), "_per_tensor_scale": t.per_tensor_scale}
        else:  # single-level (torchao's per_tensor_scale None): the block scales of a per-tensor scale 1
            qdata, scale = nvfp4_quantize(w, torch.tensor(1.0))
            t = hf_aoq.NVFP4Tensor(qdata, scale, torch.tensor(1.0), (1, 16), w.shape, torch.bfloat16)
            fields = {"qdata": qdata, "_scale_e4m3": scale}
        made[name] = t
        for f, v in fields.items():
            data[f"{module}._{leaf}_{f}"] = v.contiguous()
        attrs = {"_block_size": 16, "_orig_dtype": {"_type": "torch.dtype", "_data": "bfloat16"},
                 "_is_swizzled_scales": dynamic, "use_triton_kernel": False}
        if dynamic:
            attrs["act_quant_kwargs"] = {"_type": "QuantizeTensorToNVFP4Kwargs", "_data": {
                "block_size": 16, "is_swizzled_scales": True, "use_triton_kernel": False,
                "use_dynamic_per_tensor_scale": True}}
        entry = {"_type": "NVFP4Tensor", "_data": attrs, "_tensor_data_names": list(fields)}
        if edit:
            edit(entry, data)
        meta[name] = json.dumps(entry)
    if tensors_edit:
        tensors_edit(data)
    save_file(data, str(path), metadata=meta)
    return src, made


def weight_shape(src, name):
    config = json.loads((src / "config.json").read_text())
    h, inter = config["hidden_size"], config["intermediate_size"]
    return {DYN: (inter, h), WO: (h, h)}[name]


def test_nvfp4_converts_bit_exact_from_swizzled_and_plain_scales(tmp_path):
    src, made = nvfp4_checkpoint(tmp_path)
    summary = convert_torchao_checkpoint(src, tmp_path / "out")
    detail = {t.name: (t.torchao_type, t.aoq_type, t.detail) for t in summary.tensors}
    assert detail[DYN] == ("NVFP4Tensor", "NVFP4Tensor", "nvfp4, per-tensor and e4m3 block scales, dynamic NVFP4 activations")
    assert detail[WO] == ("NVFP4Tensor", "NVFP4Tensor", "nvfp4, single-level scales, weight-only")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for name, want in made.items():
        w = model.get_parameter(name)
        assert isinstance(w, hf_aoq.NVFP4Tensor)
        assert torch.equal(w.qdata, want.qdata)
        assert torch.equal(w.scale.view(torch.uint8), want.scale.view(torch.uint8))
        assert torch.equal(w.dequantize(), want.dequantize())
    assert model.get_parameter(DYN).act_quant == "nvfp4" and model.get_parameter(DYN).per_tensor_scale == made[DYN].per_tensor_scale
    assert model.get_parameter(WO).act_quant is None and model.get_parameter(WO).per_tensor_scale.item() == 1.0
    with torch.inference_mode():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3, 4]])).logits).all()
    recipe = json.dumps(json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"])
    assert "NVFP4InferenceConfig" in recipe and "NVFP4WeightOnlyConfig" in recipe


def refused(src, dst, *words):
    with pytest.raises(TorchaoConversionError) as info:
        convert_torchao_checkpoint(src, dst)
    for w in words:
        assert w in str(info.value), str(info.value)
    assert not dst.exists()


def test_static_activation_scales_are_refused(tmp_path):
    module, leaf = DYN.rsplit(".", 1)

    def add_static(entry, data):
        entry["_tensor_data_names"].append("_act_per_tensor_scale")
        data[f"{module}._{leaf}__act_per_tensor_scale"] = torch.tensor(0.01)

    src, _ = nvfp4_checkpoint(tmp_path, edit_dyn=add_static)
    refused(src, tmp_path / "out", repr(DYN), "'_act_per_tensor_scale' is set", "static")


def test_activations_without_a_dynamic_per_tensor_scale_are_refused(tmp_path):
    def no_dynamic(entry, data):
        entry["_data"]["act_quant_kwargs"]["_data"]["use_dynamic_per_tensor_scale"] = False

    src, _ = nvfp4_checkpoint(tmp_path, edit_dyn=no_dynamic)
    refused(src, tmp_path / "out", repr(DYN), "use_dynamic_per_tensor_scale")


def test_bad_block_size_and_scale_layout_are_refused(tmp_path):
    src, _ = nvfp4_checkpoint(tmp_path / "a", edit_wo=lambda e, d: e["_data"].update(_block_size=32))
    refused(src, tmp_path / "a" / "out", repr(WO), "_block_size 32")
    module, leaf = DYN.rsplit(".", 1)
    key = f"{module}._{leaf}__scale_e4m3"
    src, _ = nvfp4_checkpoint(tmp_path / "b", tensors_edit=lambda d: d.update({key: d[key][:-512]}))
    refused(src, tmp_path / "b" / "out", repr(DYN), "swizzled scales")
