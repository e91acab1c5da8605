"""`hf-aoq convert-torchao`: checkpoints that real torchao wrote (tests/fixtures/torchao, made by
scripts/make_torchao_fixtures.py) convert to hf_aoq, load with from_pretrained, and compute what
torchao computed; anything malformed or without an exact hf_aoq equivalent is refused by name."""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import hf_aoq
from hf_aoq.cli import main as cli_main
from hf_aoq.convert import convert_torchao_checkpoint
from hf_aoq.convert.torchao import TorchaoConversionError
from hf_aoq.core.tensor import AOQTensor

FIXTURES = Path(__file__).parents[1] / "fixtures" / "torchao"

# fixture -> (torchao type, hf_aoq type, detail, dynamic activations?)
CONVERTIBLE = {
    "int8_weight_only": ("Int8Tensor", "Int8Tensor", "int8, per row, weight-only", False),
    "int8_dynamic": ("Int8Tensor", "Int8Tensor", "int8, per row, dynamic per-token int8 activations", True),
    "float8_weight_only": ("Float8Tensor", "Float8Tensor", "float8_e4m3fn, per row, weight-only", False),
    "float8_dynamic_row": (
        "Float8Tensor", "Float8Tensor", "float8_e4m3fn, per row, dynamic float8_e4m3fn activations per row", True),
    "float8_dynamic_tensor": (
        "Float8Tensor", "Float8Tensor", "float8_e4m3fn, per tensor, dynamic float8_e4m3fn activations per tensor",
        True),
    "intx_int4_g32_sym": ("IntxUnpackedToInt8Tensor", "Int4Tensor", "int4, group 32, symmetric", False),
    "intx_int4_g64_asym": ("IntxUnpackedToInt8Tensor", "Int4Tensor", "int4, group 64, asymmetric", False),
    "intx_int8_per_row": ("IntxUnpackedToInt8Tensor", "Int8Tensor", "int8, per row", False),
    "intx_int8_embeddings": ("IntxUnpackedToInt8Tensor", "Int8Tensor", "int8, per row", False),  # + lm_head
    "int4_plain": ("Int4Tensor", "Int4Tensor", "int4, group 32, asymmetric", False),
}
LINEAR_WEIGHTS = 14  # 2 layers x (q, k, v, o, gate, up, down)


def reference(name: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / f"{name}.reference.safetensors")


def load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


def logits_of(model, input_ids) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids).logits.float()


def check_logits(got: torch.Tensor, want: torch.Tensor, dynamic: bool) -> None:
    """torchao's model and the converted one run the same weights through different kernels (and,
    with dynamic activations, round activations differently; docs/torchao.md), in bfloat16 on
    a random model whose every layer moves the logits. The bounds are relative to the logits."""
    scale = float(want.abs().max())
    diff = (got - want).abs()
    max_rel, mean_rel = (0.2, 0.03) if dynamic else (0.04, 0.006)
    assert float(diff.max()) <= max_rel * scale, f"max |diff| {float(diff.max()):.4f} vs logits up to {scale:.2f}"
    assert float(diff.mean()) <= mean_rel * scale, f"mean |diff| {float(diff.mean()):.5f} vs logits up to {scale:.2f}"


def test_fixtures_record_the_torchao_that_wrote_them():
    info = json.loads((FIXTURES / "torchao_versions.json").read_text())
    assert info["torchao"] and info["torch"] and info["transformers"]
    assert set(CONVERTIBLE) <= set(info["fixtures"])
    for name in CONVERTIBLE:
        with safe_open(str(FIXTURES / name / "model.safetensors"), framework="pt") as f:
            assert "tensor_names" in (f.metadata() or {})  # written by torchao's safetensors support


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each convertible fixture converted once: name -> (dst, summary)."""
    out = {}
    root = tmp_path_factory.mktemp("converted")
    for name in CONVERTIBLE:
        out[name] = (root / name, convert_torchao_checkpoint(FIXTURES / name, root / name))
    return out


@pytest.mark.parametrize("name", sorted(CONVERTIBLE))
def test_converts_each_torchao_type(name, converted):
    dst, summary = converted[name]
    src_type, dst_type, detail, dynamic = CONVERTIBLE[name]
    with_head = name == "intx_int8_embeddings"
    assert len(summary.tensors) == LINEAR_WEIGHTS + with_head
    assert ("lm_head.weight" in {t.name for t in summary.tensors}) == with_head
    assert {(t.torchao_type, t.aoq_type, t.detail) for t in summary.tensors} == {(src_type, dst_type, detail)}
    assert summary.plain_tensors == 7 - with_head  # embeddings, lm_head, norms

    model = load(dst)
    params = dict(model.named_parameters())
    quantized = {n for n, p in params.items() if isinstance(p, AOQTensor)}
    assert quantized == {t.name for t in summary.tensors}
    assert all(type(params[n]).__name__ == dst_type for n in quantized)

    # The dequantized weights are torchao's, to the rounding of bfloat16.
    ref = reference(name)
    checked = 0
    for key, want in ref.items():
        if not key.startswith("dequantized."):
            continue
        w = params[key.removeprefix("dequantized.")]
        got = w.dequantize()
        assert got.dtype == want.dtype == torch.bfloat16
        if name == "int4_plain":
            # torchao's float-zero formula (the reference) rounds to bfloat16 after q * scale and
            # again after adding the zero; hf_aoq rounds once. The two roundings are each at most
            # half a step of their operand, so the bound is relative to |q * scale| + |zero|.
            c = w.to_canonical()
            g = c.block_size[1]
            product = (c.codes().float() - 8) * c.scale.float().repeat_interleave(g, 1)
            terms = product.abs() + c.zero.float().repeat_interleave(g, 1).abs()
            bound = torch.finfo(torch.bfloat16).eps * terms
            assert bool(((got.float() - want.float()).abs() <= bound).all()), key
            assert float((got.float() - want.float()).abs().max()) > 0  # not trivially equal
        else:
            assert torch.equal(got, want), key
        checked += 1
    assert checked == LINEAR_WEIGHTS // 2

    check_logits(logits_of(model, ref["input_ids"]), ref["logits"], dynamic)


def test_dynamic_and_symmetric_attributes_carry_over(converted):
    params = dict(load(converted["float8_dynamic_tensor"][0]).named_parameters())
    w = params["model.layers.1.mlp.up_proj.weight"]
    assert w.act_quant == "per_tensor" and w.act_dtype == torch.float8_e4m3fn and tuple(w.scale.shape) == (1, 1)
    w = dict(load(converted["int8_dynamic"][0]).named_parameters())["model.layers.0.self_attn.q_proj.weight"]
    assert w.act_quant == "per_token"
    sym = dict(load(converted["intx_int4_g32_sym"][0]).named_parameters())["model.layers.0.mlp.up_proj.weight"]
    asym = dict(load(converted["intx_int4_g64_asym"][0]).named_parameters())["model.layers.0.mlp.up_proj.weight"]
    assert sym.to_canonical().zero is None and asym.to_canonical().zero is not None


def test_a_wrong_conversion_fails_the_logits_check(converted):
    """The logits comparison can fail: the same converted weights with the two int4 codes of
    each byte swapped (a plausible packing mistake) are far outside the bounds."""
    name = "int4_plain"
    model = load(converted[name][0])
    for module in model.modules():
        for leaf, p in list(module._parameters.items()):
            if isinstance(p, AOQTensor):
                c = p.to_canonical()
                swapped = (c.qdata >> 4) | (c.qdata << 4)
                module._parameters[leaf] = torch.nn.Parameter(c.replace(qdata=swapped), requires_grad=False)
    ref = reference(name)
    with pytest.raises(AssertionError):
        check_logits(logits_of(model, ref["input_ids"]), ref["logits"], dynamic=False)


def test_config_and_other_files(converted):
    dst, summary = converted["intx_int4_g64_asym"]
    config = json.loads((dst / "config.json").read_text())
    src_config = json.loads((FIXTURES / "intx_int4_g64_asym" / "config.json").read_text())
    qc = config.pop("quantization_config")
    assert src_config.pop("quantization_config")["quant_method"] == "torchao"
    assert config == src_config  # nothing else changes
    aoq = hf_aoq.AOQConfig.from_dict(qc)
    recipe = aoq.quant_type
    assert isinstance(recipe, hf_aoq.FqnToConfig)
    assert recipe.mapping["model.layers.1.mlp.down_proj.weight"] == hf_aoq.Int4WeightOnlyConfig(64, symmetric=False)
    assert len(recipe.mapping) == LINEAR_WEIGHTS
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (dst / f).read_bytes() == (FIXTURES / "intx_int4_g64_asym" / f).read_bytes()
    assert sorted(summary.copied_files) == ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    with safe_open(str(dst / "model.safetensors"), framework="pt") as f:
        assert "hf_aoq" in f.metadata()
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(dst)("w5 w6")["input_ids"][-2:] == [5, 6]
    recipes = json.loads((dst / "config.json").read_text())["quantization_config"]["quant_type"]["mapping"]
    assert [n for n, _ in recipes] == [t.name for t in summary.tensors]


def test_cli_converts_and_reports(tmp_path, capsys):
    dst = tmp_path / "out"
    assert cli_main(["convert-torchao", str(FIXTURES / "float8_weight_only"), str(dst)]) == 0
    printed = capsys.readouterr()
    out = printed.out
    assert "14 x Float8Tensor -> Float8Tensor" in out and "convert: " in printed.err  # a progress bar
    assert (dst / "model.safetensors").is_file()
    # DST exists now: refused in one line, DST untouched.
    before = (dst / "model.safetensors").read_bytes()
    assert cli_main(["convert-torchao", str(FIXTURES / "int8_weight_only"), str(dst)]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and len(err.strip().splitlines()) == 1
    assert (dst / "model.safetensors").read_bytes() == before
    assert cli_main(["convert-torchao", "--overwrite", str(FIXTURES / "int8_weight_only"), str(dst)]) == 0
    assert "Int8Tensor" in capsys.readouterr().out
    assert (dst / "model.safetensors").read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary or old folder left


def test_script_calls_the_same_function(tmp_path):
    import subprocess
    import sys

    script = Path(__file__).parents[2] / "scripts" / "convert_torchao.py"
    result = subprocess.run([sys.executable, str(script), str(FIXTURES / "intx_int8_per_row"), str(tmp_path / "o")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "IntxUnpackedToInt8Tensor -> Int8Tensor (int8, per row)" in result.stdout


# ---------------------------------------------------------------------- refusals
def assert_refused(src, dst, *words):
    with pytest.raises(TorchaoConversionError) as info:
        convert_torchao_checkpoint(src, dst)
    message = str(info.value)
    for w in words:
        assert w in message, message
    assert not dst.exists()
    assert not [p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")]  # no temporary left
    return message


def test_unsupported_group_size_from_real_torchao_is_refused(tmp_path):
    assert_refused(FIXTURES / "intx_int4_g16_unsupported", tmp_path / "out",
                   "'model.layers.0.self_attn.q_proj.weight'", "IntxUnpackedToInt8Tensor", "block_size [1, 16]")


def edited_copy(tmp_path, name="int8_weight_only", *, tensors=None, metadata=None, config=None):
    """A copy of a fixture whose stored tensors / torchao metadata / config.json were edited by
    the given functions (each takes and returns a dict)."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / name, src)
    path = src / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    data = load_file(path)
    if tensors:
        data = tensors(data)
    if metadata:
        meta = metadata(meta)
    save_file(data, str(path), metadata=meta)
    if config:
        c = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps(config(c)))
    return src


def edit_entry(name, fn):
    def edit(meta):
        entry = json.loads(meta[name])
        fn(entry)
        meta[name] = json.dumps(entry)
        return meta
    return edit


W = "model.layers.1.mlp.up_proj.weight"
K = "model.layers.1.mlp.up_proj._weight_"


def test_wrong_field_dtype_is_refused(tmp_path):
    src = edited_copy(tmp_path, tensors=lambda d: {**d, K + "scale": d[K + "scale"].to(torch.int32)})
    assert_refused(src, tmp_path / "out", repr(W), "'scale'", "torch.int32")


def test_wrong_field_shape_is_refused(tmp_path):
    src = edited_copy(tmp_path, tensors=lambda d: {**d, K + "scale": d[K + "scale"][:64]})
    assert_refused(src, tmp_path / "out", repr(W), "'scale'", "shape")


def test_missing_field_is_refused(tmp_path):
    src = edited_copy(tmp_path, tensors=lambda d: {k: v for k, v in d.items() if k != K + "qdata"})
    assert_refused(src, tmp_path / "out", repr(W), "'qdata'", "not in the checkpoint")


def test_field_missing_from_metadata_is_refused(tmp_path):
    src = edited_copy(tmp_path, metadata=edit_entry(W, lambda e: e["_tensor_data_names"].remove("scale")))
    assert_refused(src, tmp_path / "out", repr(W), "required field 'scale'")


def test_unknown_tensor_type_is_refused(tmp_path):
    src = edited_copy(tmp_path, metadata=edit_entry(W, lambda e: e.update(_type="SomeFutureTensor")))
    assert_refused(src, tmp_path / "out", repr(W), "unknown torchao tensor type", "SomeFutureTensor")


def test_known_but_unsupported_tensor_type_is_refused(tmp_path):
    src = edited_copy(tmp_path, metadata=edit_entry(W, lambda e: e.update(_type="Int4TilePackedTo4dTensor")))
    assert_refused(src, tmp_path / "out", repr(W), "Int4TilePackedTo4dTensor", "not supported")


def test_value_types_outside_the_allow_list_are_refused(tmp_path):
    def evil(e):
        e["_data"]["act_quant_kwargs"] = {"_type": "os.system", "_data": {"command": "echo hi"}}

    src = edited_copy(tmp_path, metadata=edit_entry(W, evil))
    assert_refused(src, tmp_path / "out", repr(W), "'act_quant_kwargs'", "'os.system'")


def test_unknown_attribute_is_refused(tmp_path):
    src = edited_copy(tmp_path, metadata=edit_entry(W, lambda e: e["_data"].update(new_meaning=True)))
    assert_refused(src, tmp_path / "out", repr(W), "unknown attribute 'new_meaning'")


def test_asymmetric_int8_is_refused(tmp_path):
    def shift(d):
        zp = d[K + "zero_point"].clone()
        zp[3] = 5
        return {**d, K + "zero_point": zp}

    src = edited_copy(tmp_path, tensors=shift)
    assert_refused(src, tmp_path / "out", repr(W), "zero_point", "symmetric")


def test_float8_activations_with_int4_weights_convert(tmp_path):
    """torchao's Float8DynamicActivationInt4WeightConfig (plain int4, activation_dtype e4m3): an
    Int4Tensor with per-token e4m3 activations; other activation dtypes are refused."""
    name = "model.layers.0.mlp.down_proj.weight"
    src = edited_copy(tmp_path, "int4_plain", metadata=edit_entry(
        name, lambda e: e["_data"].update(activation_dtype={"_type": "torch.dtype", "_data": "float8_e4m3fn"})))
    summary = convert_torchao_checkpoint(src, tmp_path / "out")
    detail = {t.name: t.detail for t in summary.tensors}
    assert detail[name] == "int4, group 32, asymmetric, dynamic float8_e4m3fn activations per token"
    assert detail["model.layers.0.mlp.up_proj.weight"] == "int4, group 32, asymmetric"
    model = load(tmp_path / "out")
    w = model.get_parameter(name)
    assert isinstance(w, hf_aoq.Int4Tensor) and w.act_quant == "per_token" and w.act_dtype == torch.float8_e4m3fn
    recipe = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["quant_type"]
    assert "Float8DynamicActivationInt4WeightConfig" in json.dumps(recipe)
    bad = edited_copy(tmp_path / "b", "int4_plain", metadata=edit_entry(
        name, lambda e: e["_data"].update(activation_dtype={"_type": "torch.dtype", "_data": "float8_e5m2"})))
    assert_refused(bad, tmp_path / "b" / "out", repr(name), "activation_dtype", "float8_e4m3fn")


def test_int4_codes_labelled_with_a_narrower_bit_width_are_refused(tmp_path):
    # int3 converts to IntxTensor now (test_other_bit_widths_convert_to_intx); int4's codes do
    # not fit in it.
    name = "model.layers.0.mlp.gate_proj.weight"
    src = edited_copy(tmp_path, "intx_int4_g32_sym", metadata=edit_entry(
        name, lambda e: e["_data"].update(target_dtype={"_type": "torch.dtype", "_data": "int3"})))
    assert_refused(src, tmp_path / "out", repr(name), "int3 codes outside [-4, 3]")


@pytest.mark.parametrize("bits, fixture", [(2, "intx_int4_g32_sym"), (3, "intx_int4_g64_asym"),
                                           (6, "intx_int4_g64_asym"), (8, "intx_int8_per_row")])
def test_other_bit_widths_convert_to_intx(bits, fixture, tmp_path):
    """IntxUnpackedToInt8Tensor of int1-3, int5-7 (and asymmetric int8) becomes an IntxTensor
    that dequantizes as torchao's formula says. The fixtures' codes are narrowed (or an int8
    zero point shifted) to make such a checkpoint."""
    name = "model.layers.0.mlp.gate_proj.weight"
    key = "model.layers.0.mlp.gate_proj._weight_"
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1

    def narrow(d):
        d = dict(d)
        d[key + "qdata"] = d[key + "qdata"].clamp(lo, hi)
        if bits == 8:
            zp = d[key + "zero_point"].clone()
            zp[::2] = 3
            d[key + "zero_point"] = zp
        return d

    src = edited_copy(tmp_path, fixture, tensors=narrow, metadata=edit_entry(
        name, lambda e: e["_data"].update(target_dtype={"_type": "torch.dtype", "_data": f"int{bits}"})))
    torchao_fields = load_file(src / "model.safetensors")
    summary = convert_torchao_checkpoint(src, tmp_path / "out")
    assert f"IntxUnpackedToInt8Tensor -> IntxTensor (int{bits}" in summary.format()
    w = dict(load(tmp_path / "out").named_parameters())[name]
    assert isinstance(w, hf_aoq.IntxTensor) and w.bits == bits
    q, s, zp = (torchao_fields[key + f] for f in ("qdata", "scale", "zero_point"))
    g = q.shape[1] // s.shape[1]
    want = (q.float() - zp.float().repeat_interleave(g, 1)) * s.float().repeat_interleave(g, 1)
    assert torch.allclose(w.dequantize().float(), want, rtol=2 ** -7, atol=0)
    assert (w.zero is None) == (not bool(zp.any()))


def test_stray_tensor_is_refused(tmp_path):
    src = edited_copy(tmp_path, tensors=lambda d: {**d, "model.layers.0.mlp.up_proj._weight_extra": torch.zeros(2)})
    assert_refused(src, tmp_path / "out", "'model.layers.0.mlp.up_proj._weight_extra'", "belongs to no tensor")


def test_bad_json_is_refused(tmp_path):
    src = edited_copy(tmp_path, metadata=lambda m: {**m, W: '{"_type": "Int8Tensor", "_type": "Int8Tensor"}'})
    assert_refused(src, tmp_path / "out", repr(W), "appears twice")
    shutil.rmtree(tmp_path / "src")
    src = edited_copy(tmp_path, metadata=lambda m: {**m, "tensor_names": "[NaN]"})
    assert_refused(src, tmp_path / "out", "tensor_names", "NaN")


def test_a_checkpoint_without_torchao_metadata_is_refused(tmp_path):
    src = edited_copy(tmp_path, metadata=lambda m: {"format": "pt"})
    assert_refused(src, tmp_path / "out", "not a checkpoint written by torchao")
    shutil.rmtree(tmp_path / "src")
    src = edited_copy(tmp_path, config=lambda c: {k: v for k, v in c.items() if k != "quantization_config"})
    assert_refused(src, tmp_path / "out", "not a torchao checkpoint")


def test_pickle_checkpoints_are_never_read(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(FIXTURES / "int8_weight_only" / "config.json", src)
    (src / "pytorch_model.bin").write_bytes(b"not read")
    assert_refused(src, tmp_path / "out", "pytorch_model.bin", "pickle")


# ---------------------------------------------------------------------- other layouts
def sharded_source(tmp_path):
    """A torchao checkpoint in two shards and an index, as transformers writes one."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "intx_int4_g64_asym", src)
    path = src / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    data = load_file(path)
    path.unlink()
    keys = sorted(data)
    weight_map = {}
    for i, names in enumerate((keys[::2], keys[1::2]), 1):
        shard = f"model-0000{i}-of-00002.safetensors"
        save_file({k: data[k] for k in names}, str(src / shard), metadata=meta)
        weight_map.update({k: shard for k in names})
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return src, weight_map


def test_sharded_checkpoint_converts_like_one_file(tmp_path, converted):
    """transformers writes the whole torchao metadata into every shard, next to an index."""
    src, _ = sharded_source(tmp_path)
    summary = convert_torchao_checkpoint(src, tmp_path / "out")
    assert len(summary.tensors) == LINEAR_WEIGHTS
    assert not any(f.startswith("model-") for f in summary.copied_files)
    one = load_file(converted["intx_int4_g64_asym"][0] / "model.safetensors")
    two = load_file(tmp_path / "out" / "model.safetensors")
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)


@pytest.mark.parametrize("where", ["../x.safetensors", "absolute"])
def test_a_source_index_naming_a_file_outside_the_folder_is_refused(tmp_path, where):
    src, weight_map = sharded_source(tmp_path)
    os.replace(src / "model-00002-of-00002.safetensors", tmp_path / "x.safetensors")
    name = str(tmp_path / "x.safetensors") if where == "absolute" else where
    weight_map = {k: name if v.startswith("model-00002") else v for k, v in weight_map.items()}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert_refused(src, tmp_path / "out", "model.safetensors.index.json", "not a .safetensors file in the index's")


def test_a_source_with_both_a_single_file_and_an_index_is_refused(tmp_path):
    src, _ = sharded_source(tmp_path)
    shutil.copy(FIXTURES / "int8_weight_only" / "model.safetensors", src / "model.safetensors")
    assert_refused(src, tmp_path / "out", "holds both model.safetensors and model.safetensors.index.json")


def test_sharded_output_carries_one_save_id(tmp_path):
    out = tmp_path / "out"
    convert_torchao_checkpoint(FIXTURES / "intx_int4_g64_asym", out, max_shard_size=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    ids = set()
    for shard in set(index["weight_map"].values()):
        with safe_open(str(out / shard), framework="pt") as f:
            ids.add(f.metadata()["hf_aoq_save_id"])
    assert ids == {index["metadata"]["hf_aoq_save_id"]}


def test_tied_weight_left_out_by_transformers_is_reported(tmp_path):
    src = edited_copy(tmp_path, tensors=lambda d: {k: v for k, v in d.items() if k != "lm_head.weight"})
    summary = convert_torchao_checkpoint(src, tmp_path / "out")
    assert any("lm_head.weight" in n for n in summary.notes)
    assert "lm_head.weight" not in load_file(tmp_path / "out" / "model.safetensors")


def test_per_tensor_int8_becomes_per_row_with_the_same_values(tmp_path):
    """torchao's per-tensor Int8Tensor (block = the whole weight, scale [1, 1]) is stored by hf_aoq
    as per row with the one scale repeated: the same dequantized values."""
    s = torch.tensor([[0.0123]], dtype=torch.float32)

    def per_tensor_scale(d):
        return {**d, K + "scale": s, K + "zero_point": torch.zeros(1, 1, dtype=torch.int8)}

    src = edited_copy(tmp_path, tensors=per_tensor_scale,
                      metadata=edit_entry(W, lambda e: e["_data"].update(block_size=[128, 64])))
    summary = convert_torchao_checkpoint(src, tmp_path / "out")
    assert {t.detail for t in summary.tensors if t.name == W} == {"int8, per row, weight-only"}
    params = dict(load(tmp_path / "out").named_parameters())
    w = params[W]
    qdata = load_file(src / "model.safetensors")[K + "qdata"]
    assert tuple(w.block_size) == (1, 64) and tuple(w.scale.shape) == (128, 1)
    assert torch.equal(w.dequantize(), (qdata.float() * s).to(torch.bfloat16))


def test_large_output_is_sharded_with_an_index(tmp_path, converted):
    name = "intx_int4_g64_asym"
    summary = convert_torchao_checkpoint(FIXTURES / name, tmp_path / "out", max_shard_size=40_000)
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 2 and "model.safetensors" not in files and "model.safetensors.index.json" in files
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    stored = {}
    for shard in shards:
        stored.update({k: shard for k in load_file(tmp_path / "out" / shard)})
    assert index["weight_map"] == stored
    ref = reference(name)
    one = logits_of(load(converted[name][0]), ref["input_ids"])
    assert torch.equal(logits_of(load(tmp_path / "out"), ref["input_ids"]), one)
    assert len(summary.tensors) == LINEAR_WEIGHTS


def _stored(folder: Path) -> dict[str, torch.Tensor]:
    """Every stored tensor of a checkpoint folder, over all its .safetensors files."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("size", ["40KB", "40000"])
def test_cli_max_shard_size_shards_the_output(size, tmp_path, converted, capsys):
    name = "intx_int4_g64_asym"
    dst = tmp_path / "out"
    assert cli_main(["convert-torchao", str(FIXTURES / name), str(dst), "--max-shard-size", size]) == 0
    assert "IntxUnpackedToInt8Tensor -> Int4Tensor" in capsys.readouterr().out
    files = sorted(p.name for p in dst.iterdir())
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 2 and "model.safetensors" not in files and "model.safetensors.index.json" in files
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    one, sharded = _stored(converted[name][0]), _stored(dst)
    assert set(index["weight_map"]) == set(one)
    assert one.keys() == sharded.keys() and all(torch.equal(one[k], sharded[k]) for k in one)
    ref = reference(name)
    whole = logits_of(load(converted[name][0]), ref["input_ids"])
    assert torch.equal(logits_of(load(dst), ref["input_ids"]), whole)


def test_cli_default_keeps_one_file(converted):
    # The fixtures are far below the 5 GiB default: one model.safetensors, no index.
    dst = converted["intx_int4_g64_asym"][0]
    assert sorted(p.name for p in dst.glob("model*")) == ["model.safetensors"]


@pytest.mark.parametrize("size", ["40XB", "lots", "0", "1.5", "5GiB"])
def test_cli_bad_max_shard_size_is_one_line(size, tmp_path, capsys):
    dst = tmp_path / "out"
    assert cli_main(["convert-torchao", str(FIXTURES / "int8_weight_only"), str(dst), "--max-shard-size", size]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"hf-aoq convert-torchao: --max-shard-size {size}: "), err
    assert "500MB" in err and "bytes" in err
    assert not dst.exists() and list(tmp_path.iterdir()) == []


def test_script_takes_max_shard_size(tmp_path, converted, capsys):
    """In-process (test_script_calls_the_same_function above runs the script as a program)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_torchao_script",
                                                  Path(__file__).parents[2] / "scripts" / "convert_torchao.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    name = "intx_int8_per_row"
    dst = tmp_path / "o"
    assert script.main([str(FIXTURES / name), str(dst), "--max-shard-size", "30KB"]) == 0
    assert len(list(dst.glob("model-*.safetensors"))) > 2 and (dst / "model.safetensors.index.json").is_file()
    one, sharded = _stored(converted[name][0]), _stored(dst)
    assert one.keys() == sharded.keys() and all(torch.equal(one[k], sharded[k]) for k in one)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        script.main([str(FIXTURES / name), str(tmp_path / "bad"), "--max-shard-size", "30XB"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--max-shard-size 30XB: not a size" in err.splitlines()[-1] and not (tmp_path / "bad").exists()


# ---------------------------------------------------------------------- int8 asymmetric activations
def with_activation_quantization(value):
    """Every IntxUnpackedToInt8Tensor entry's activation_quantization set to `value`, as torchao's
    Int8DynamicActivationIntxWeightConfig (act_mapping_type ASYMMETRIC) writes it."""
    def edit(meta):
        for name, entry in list(meta.items()):
            if name != "tensor_names" and '"IntxUnpackedToInt8Tensor"' in entry:
                e = json.loads(entry)
                e["_data"]["activation_quantization"] = value
                meta[name] = json.dumps(e)
        return meta
    return edit


@pytest.mark.parametrize("value", ["int8_asym_per_token",
                                   {"_type": "IntxUnpackedToInt8TensorActivationQuantization",
                                    "_data": "INT8_ASYM_PER_TOKEN"}], ids=["value", "enum"])
def test_int8_asymmetric_activations_convert_to_intx(value, tmp_path):
    """IntxUnpackedToInt8Tensor with int8 asymmetric per-token activations: an IntxTensor with
    act_quant "per_token_asymmetric" whose linear is torchao's (the activation fake-quantized by
    torchao's formula, then the dequantized weight), exactly."""
    from torchao_formulas import torchao_int8_asym_per_token64

    src = edited_copy(tmp_path, "intx_int4_g64_asym", metadata=with_activation_quantization(value))
    summary = convert_torchao_checkpoint(src, tmp_path / "out")
    assert len(summary.tensors) == LINEAR_WEIGHTS
    acts = "asymmetric, dynamic asymmetric per-token int8 activations"
    assert {(t.torchao_type, t.aoq_type, t.detail) for t in summary.tensors} == {
        ("IntxUnpackedToInt8Tensor", "IntxTensor", f"int4, group 64, {acts}"),
        ("IntxUnpackedToInt8Tensor", "IntxTensor", f"int4, per row, {acts}"),  # the weights with 64 inputs
    }
    recipe = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["quant_type"]
    text = json.dumps(recipe)
    assert "Int8DynamicActivationIntxWeightConfig" in text and '"act_mapping_type": "asymmetric"' in text

    model = load(tmp_path / "out")
    name = "model.layers.0.mlp.down_proj.weight"
    key = "model.layers.0.mlp.down_proj._weight_"
    w = model.get_parameter(name)
    assert isinstance(w, hf_aoq.IntxTensor) and w.act_quant == "per_token_asymmetric" and w.bits == 4
    fields = load_file(src / "model.safetensors")
    q, s, zp = (fields[key + f] for f in ("qdata", "scale", "zero_point"))
    g = q.shape[1] // s.shape[1]
    torchao_w = ((q.to(torch.bfloat16) - zp.to(torch.bfloat16).repeat_interleave(g, 1))
                 * s.repeat_interleave(g, 1)).to(torch.bfloat16)
    x = torch.randn(3, 5, q.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    x[0, 0] = x[0, 0].abs()  # a token with no negative value
    want = F.linear(torchao_int8_asym_per_token64(x).to(torch.bfloat16), torchao_w)
    assert torch.equal(F.linear(x, w), want)
    ref = reference("intx_int4_g64_asym")
    logits = logits_of(model, ref["input_ids"])
    assert torch.isfinite(logits).all()
    check_logits(logits, ref["logits"], dynamic=True)  # torchao's weight-only model, now with int8 activations


def test_unknown_activation_quantization_is_refused(tmp_path):
    src = edited_copy(tmp_path, "intx_int4_g64_asym", metadata=with_activation_quantization("int8_sym_per_token"))
    assert_refused(src, tmp_path / "out", "IntxUnpackedToInt8Tensor", "activation_quantization",
                   "'int8_sym_per_token'", "int8_asym_per_token")
