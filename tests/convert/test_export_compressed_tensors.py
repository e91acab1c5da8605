"""`hf-aoq export --format compressed-tensors` and `hf-aoq convert`: hf_aoq checkpoints of a tiny
Llama go to compressed-tensors bit-exactly, load through transformers' own compressed-tensors
integration (compressed-tensors installed, hf_aoq's "aoq" method not involved) with the same
weights and logits, convert back to the identical hf_aoq tensors; weights with no exact form
are refused by name with nothing written, or re-quantized with --requantize."""
import json
import os
from pathlib import Path

import pytest
import torch

import hf_aoq
from hf_aoq import (AOQConfig, Float8DynamicActivationFloat8WeightConfig, Float8WeightOnlyConfig, FqnToConfig,
                    Int4DQWeightOnlyConfig, Int4WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig,
                    Int8WeightOnlyConfig, Int8DynamicActivationInt4WeightConfig,
                    Float8StaticActivationFloat8WeightConfig)
from hf_aoq.cli import main as cli_main
from hf_aoq.convert import compressed_tensors as ct
from hf_aoq.core.granularity import PerTensor
from hf_aoq.core.tensor import AOQTensor
from hf_aoq.serialization import load_checkpoint
from hf_aoq.tensors import Int4Tensor
from hf_aoq.workflows import ExportError, convert_checkpoint, export_checkpoint

pytest.importorskip("compressed_tensors")

FIXTURES = Path(__file__).parents[1] / "fixtures" / "torchao"
RECIPES = {
    "int4_g32": Int4WeightOnlyConfig(group_size=32, symmetric=True),
    "int4_g128": Int4WeightOnlyConfig(group_size=128, symmetric=True),
    "int8": Int8WeightOnlyConfig(),
    "int8_dyn": Int8DynamicActivationInt8WeightConfig(),
    "fp8": Float8WeightOnlyConfig(),
    "fp8_dyn_tensor": Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()),
    "mixed": FqnToConfig({"re:.*self_attn.*": Int4WeightOnlyConfig(group_size=64, symmetric=True),
                          "re:.*down_proj": Float8DynamicActivationFloat8WeightConfig(),
                          "_default": Int8WeightOnlyConfig(group_size=64)}),
}
DYNAMIC = {"int8_dyn", "fp8_dyn_tensor", "mixed"}  # compressed-tensors rounds activations its own way
IDS = torch.tensor([[1, 5, 9, 33, 100, 7, 250, 3]])


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    from conftest import tiny_llama_checkpoint

    path = tmp_path_factory.mktemp("float")
    tiny_llama_checkpoint(path)
    return path


def quantized(float_dir, root: Path, recipe) -> Path:
    from transformers import AutoModelForCausalLM

    out = root / "aoq"
    AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=AOQConfig(recipe)).save_pretrained(out)
    return out


def load(path, dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.inference_mode():
        logits = model(IDS).logits.float()  # compressed-tensors decompresses on the first forward
    return model, logits


def float_model_with(float_dir, weights: dict[str, torch.Tensor], dtype=torch.bfloat16):
    """The float model with each quantized weight replaced by hf_aoq's dequantization: what the
    reference kernel computes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=dtype).eval()
    with torch.no_grad():
        for name, t in weights.items():
            if isinstance(t, AOQTensor):
                model.get_parameter(name).copy_(t.dequantize(dtype))
    with torch.inference_mode():
        return model(IDS).logits.float()


def assert_same_tensor(a, b, name):
    assert type(a) is type(b), name
    fa, fb = a.to_canonical().fields(), b.to_canonical().fields()
    assert fa.keys() == fb.keys(), name
    for f in fa:
        x, y = fa[f], fb[f]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert x is not None and y is not None and x.dtype == y.dtype and torch.equal(x, y), (name, f)
        else:
            assert x == y, (name, f)


# ---------------------------------------------------------------------- the packing claim
def test_int4_nibbles_are_compressed_tensors_int32_packing():
    """hf_aoq's qdata (even column in the low nibble) viewed as int32 is what compressed-tensors'
    own packer makes of the same codes; so are hf_aoq's 8-bit and zero-point packings."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    from hf_aoq.core.primitives import pack_int4

    torch.manual_seed(0)
    codes = torch.randint(0, 16, (24, 64), dtype=torch.uint8)
    ours = ct._bytes_to_int32(pack_int4(codes))
    assert torch.equal(ours, pack_int4(codes).view(torch.int32))  # little-endian: a plain view
    assert torch.equal(ours, pack_to_int32((codes.to(torch.int16) - 8).to(torch.int8), 4))
    q8 = torch.randint(-128, 128, (5, 12), dtype=torch.int16).to(torch.int8)
    assert torch.equal(ct._bytes_to_int32(q8.view(torch.uint8) ^ 0x80), pack_to_int32(q8, 8))
    zp = torch.randint(-8, 8, (13, 3), dtype=torch.int16)
    packed = pack_to_int32(zp.to(torch.int8), 4, packed_dim=0)
    assert torch.equal(ct._pack_zero_points(zp), packed)
    assert torch.equal(ct._unpack_zero_points(packed, 13), zp)
    assert torch.equal(unpack_from_int32(packed, 4, torch.Size([13, 3]), packed_dim=0).to(torch.int16), zp)


# ---------------------------------------------------------------------- export, load, convert back
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_export_loads_in_transformers_and_converts_back(float_dir, tmp_path, recipe):
    src = quantized(float_dir, tmp_path, RECIPES[recipe])
    out, back = tmp_path / "ct", tmp_path / "back"
    summary = export_checkpoint(src, out)
    assert sum(summary.groups.values()) == 14 and not summary.requantized
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
    assert "lm_head" in qc["ignore"]
    card = (out / "README.md").read_text()
    assert "vllm serve" in card and "sglang.launch_server" in card and "bit-exactly" in card
    ours = load_checkpoint(src)
    quantized_names = [n for n, t in ours.items() if isinstance(t, AOQTensor)]

    # float32: compressed-tensors' decompressed weights are hf_aoq's dequantization, bit for bit.
    model, _ = load(out, torch.float32)
    state = model.state_dict()
    for name in quantized_names:
        assert torch.equal(state[name], ours[name].dequantize(torch.float32)), name

    # bfloat16: transformers' compressed-tensors integration makes weight_scale in the model's
    # dtype, so hf_aoq's float32 int8/fp8 scales are rounded to bfloat16 there (not in the
    # file: vLLM's W8A8 and FP8 kernels keep them in float32); int4 scales are bfloat16 already.
    model, got = load(out)
    want = float_model_with(float_dir, ours)
    if recipe.startswith("int4"):
        assert torch.equal(got, want)
    else:
        state = model.state_dict()
        for name in quantized_names:
            w = ours[name].dequantize(torch.float32)
            # one bf16 rounding of the scale, then of the product: 2 ulps of bf16
            assert ((state[name].float() - w).abs() <= w.abs() * 2**-7).all(), name
        scale = float(want.abs().max())
        bound = (0.1 if recipe in DYNAMIC else 0.05) * scale  # activations rounded differently too
        assert float((got - want).abs().max()) <= bound, recipe

    # hf_aoq's own model (its CPU kernels) computes the same, to the kernels' rounding.
    from transformers import AutoModelForCausalLM

    aoq = AutoModelForCausalLM.from_pretrained(src).eval()
    with torch.inference_mode():
        mine = aoq(IDS).logits.float()
    assert float((got - mine).abs().max()) <= 0.1 * float(mine.abs().max())

    # and back: convert gives the identical hf_aoq tensors, and plain ones unchanged.
    text = convert_checkpoint(out, back).format_text()
    assert "-> Int" in text or "-> Float8Tensor" in text
    again = load_checkpoint(back)
    assert again.keys() == ours.keys()
    for name, t in ours.items():
        if isinstance(t, AOQTensor):
            assert_same_tensor(t, again[name], name)
        else:
            assert torch.equal(t, again[name]), name
    reloaded = AutoModelForCausalLM.from_pretrained(back).eval()
    with torch.inference_mode():
        assert torch.equal(reloaded(IDS).logits.float(), mine)


def test_asymmetric_int4_with_integer_zero_points(float_dir, tmp_path):
    """An asymmetric Int4Tensor whose zeros are whole multiples of the scale (what torchao's
    intx int4 converts to) goes with packed weight_zero_point; a float zero is refused."""
    from hf_aoq.serialization import save_file

    src = quantized(float_dir, tmp_path, Int4WeightOnlyConfig(group_size=32, symmetric=True))
    state = load_checkpoint(src)
    name = "model.layers.0.mlp.up_proj.weight"
    t = state[name].to_canonical()
    zp = torch.randint(-8, 8, t.scale.shape, generator=torch.Generator().manual_seed(0))
    # float32 scales that bfloat16 holds (torchao's converted int4 has them): zp * scale is exact
    scale = t.scale.float()
    t = t.replace(scale=scale)
    state[name] = t.replace(zero=-zp * scale)
    os.remove(src / "model.safetensors")
    save_file(state, src / "model.safetensors")
    summary = export_checkpoint(src, tmp_path / "ct")
    assert any("asymmetric" in g for g in summary.groups)
    # transformers 5.24 with compressed-tensors 0.20.1 builds the zero point unpacked ([N, G])
    # and cannot load this layout (the one compressed-tensors' compressor writes and vLLM reads),
    # so the check is compressed-tensors' own decompression of the stored tensors.
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    group = next(g for g in qc["config_groups"].values() if not g["weights"]["symmetric"])
    assert group["targets"] == [name.removesuffix(".weight")]
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])
    stored = load_file(tmp_path / "ct" / "model.safetensors")
    module = name.removesuffix(".weight")
    local = {k.removeprefix(module + "."): v for k, v in stored.items() if k.startswith(module + ".")}
    assert set(local) == {"weight_packed", "weight_scale", "weight_shape", "weight_zero_point"}
    weight = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
    assert torch.equal(weight.to(torch.bfloat16), state[name].dequantize())
    convert_checkpoint(tmp_path / "ct", tmp_path / "back")
    assert_same_tensor(state[name], load_checkpoint(tmp_path / "back")[name], name)

    state[name] = t.replace(zero=-zp * scale + 0.25 * scale)
    os.remove(src / "model.safetensors")
    save_file(state, src / "model.safetensors")
    with pytest.raises(ExportError, match=rf"{name}.*zero points are integers"):
        export_checkpoint(src, tmp_path / "ct2")
    assert not (tmp_path / "ct2").exists()


def test_torchao_checkpoint_converts_then_exports(tmp_path):
    """`convert` detects a torchao checkpoint (what convert-torchao did) and its int4 exports."""
    src = FIXTURES / "intx_int4_g32_sym"
    aoq = tmp_path / "aoq"
    assert "IntxUnpackedToInt8Tensor -> Int4Tensor" in convert_checkpoint(src, aoq).format()
    export_checkpoint(aoq, tmp_path / "ct")
    convert_checkpoint(tmp_path / "ct", tmp_path / "back")
    ours, back = load_checkpoint(aoq), load_checkpoint(tmp_path / "back")
    for name, t in ours.items():
        if isinstance(t, AOQTensor):
            assert_same_tensor(t, back[name], name)


# ---------------------------------------------------------------------- refusals
def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("recipe, why", [
    (Int4DQWeightOnlyConfig(), "Int4DQ stores 4-bit indices"),
    (Int4WeightOnlyConfig(group_size=256, symmetric=True), "partial group of 128"),
    (Int4WeightOnlyConfig(group_size=32), "zero points are integers"),  # asymmetric, float zeros
    (Float8WeightOnlyConfig(weight_dtype=torch.float8_e5m2), "e4m3fn"),
    # Activation-quantized weights are not exported as weight-only ones (were: int4 silently so).
    (Int8DynamicActivationInt4WeightConfig(), "activations quantized to torch.int8 per token"),
    (Float8StaticActivationFloat8WeightConfig(scale=0.01), "static activation scale"),
])
def test_not_exact_is_refused_by_name_and_nothing_written(float_dir, tmp_path, capsys, recipe, why):
    src = quantized(float_dir, tmp_path, recipe)
    out = tmp_path / "out" / "ct"
    out.parent.mkdir()
    with pytest.raises(ExportError, match=rf"model\.layers\.\d\.\w+\.\w+_proj\.weight .*{why}"):
        export_checkpoint(src, out)
    assert not out.exists() and not _leftovers(out.parent)
    assert cli_main(["export", str(src), str(out), "--format", "compressed-tensors"]) == 2
    err = capsys.readouterr().err
    assert why in err and "Nothing was written" in err and "--requantize" in err
    assert not out.exists() and not _leftovers(out.parent)


def test_requantize_says_so_and_loads(float_dir, tmp_path, capsys):
    src = quantized(float_dir, tmp_path, Int4DQWeightOnlyConfig())
    out = tmp_path / "ct"
    assert cli_main(["export", str(src), str(out), "--format", "compressed-tensors", "--requantize"]) == 0
    text = capsys.readouterr().out
    assert "14 weights were NOT exact" in text and "re-quantized to symmetric int4, group 32" in text
    card = (out / "README.md").read_text()
    assert "re-quantized" in card and "model.layers.0.self_attn.q_proj.weight" in card
    # transformers computes exactly what the re-quantized weights (converted back) say; they are
    # a second rounding of Int4DQ's, close to them but not equal.
    from conftest import sqnr

    _, got = load(out)
    convert_checkpoint(out, tmp_path / "back")
    requantized, ours = load_checkpoint(tmp_path / "back"), load_checkpoint(src)
    assert torch.equal(got, float_model_with(float_dir, requantized))
    for name, t in ours.items():
        if isinstance(t, AOQTensor):
            assert type(requantized[name]) is Int4Tensor and requantized[name].zero is None
            assert 15 < sqnr(t.dequantize(), requantized[name].dequantize()) < float("inf"), name


def test_existing_out_and_non_aoq_source_are_refused(float_dir, tmp_path):
    src = quantized(float_dir, tmp_path, RECIPES["int8"])
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="already exists"):
        export_checkpoint(src, tmp_path / "taken")
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    export_checkpoint(src, tmp_path / "taken", overwrite=True)
    assert not (tmp_path / "taken" / "keep.txt").exists()
    with pytest.raises(ExportError, match="not 'aoq'"):
        export_checkpoint(float_dir, tmp_path / "x")
    with pytest.raises(ExportError, match="convert takes torchao, compressed-tensors"):
        convert_checkpoint(src, tmp_path / "y")


def test_convert_refuses_what_hf_aoq_has_no_type_for(float_dir, tmp_path):
    src = quantized(float_dir, tmp_path, RECIPES["int4_g32"])
    out = tmp_path / "ct"
    export_checkpoint(src, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match=r"model\.layers\.0\.\w+\.\w+_proj: .*activation reordering"):
        convert_checkpoint(out, tmp_path / "back")
    assert not (tmp_path / "back").exists() and not _leftovers(tmp_path)
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = None
    config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float"}
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="kv_cache_scheme"):
        convert_checkpoint(out, tmp_path / "back")
    assert not (tmp_path / "back").exists()


# ---------------------------------------------------------------------- quantize --target
def test_quantize_target_compressed_tensors_exports_without_loss(tmp_path, capsys):
    """`--scheme int4 --target compressed-tensors` makes symmetric int4 at groups of 128 and
    keeps in float the layers vLLM's Marlin kernels cannot run (here down_proj, input 192), so
    `export` needs no --requantize (while plain `--scheme int4`, Int4DQ, would be refused)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "float")
    src, out = tmp_path / "aoq", tmp_path / "ct"
    assert cli_main(["quantize", str(tmp_path / "float"), "--scheme", "int4", "--target", "compressed-tensors",
                     "--out", str(src), "--no-measure"]) == 0
    assert "2 linear layers stay in float" in capsys.readouterr().out
    ours = load_checkpoint(src)
    kinds = {n: (type(t).__name__, getattr(t, "block_size", None), getattr(t, "zero", 0) is None)
             for n, t in ours.items() if isinstance(t, AOQTensor)}
    assert len(kinds) == 12 and set(kinds.values()) == {("Int4Tensor", (1, 128), True)}
    assert not any("down_proj" in n for n in kinds)
    summary = export_checkpoint(src, out)
    assert summary.groups == {"pack-quantized int4 group 128, weight-only": 12} and not summary.requantized
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert {"model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"} <= set(qc["ignore"])
    _, got = load(out)
    assert torch.equal(got, float_model_with(tmp_path / "float", ours))
    assert cli_main(["quantize", str(tmp_path / "float"), "--scheme", "int4", "--group-size", "256", "--target",
                     "compressed-tensors", "--out", str(tmp_path / "x")]) == 2
    assert "take groups of 32, 64, 128" in capsys.readouterr().err


def test_quantized_embeddings_are_refused_or_kept_in_float(float_dir, tmp_path):
    """compressed-tensors quantizes linear layers: a quantized embedding is refused by name, and
    --requantize stores it dequantized (and lists it), while lm_head, a linear layer, goes."""
    from transformers import AutoModelForCausalLM

    src = tmp_path / "aoq"
    config = AOQConfig(Int8WeightOnlyConfig(), include_input_output_embeddings=True)
    AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=config).save_pretrained(src)
    ours = load_checkpoint(src)
    assert isinstance(ours["model.embed_tokens.weight"], AOQTensor)
    with pytest.raises(ExportError, match=r"model\.embed_tokens\.weight .*not the weight of a linear layer"):
        export_checkpoint(src, tmp_path / "ct")
    assert not (tmp_path / "ct").exists()
    summary = export_checkpoint(src, tmp_path / "ct", requantize=True)
    assert [r.split(":")[0] for r in summary.requantized] == ["model.embed_tokens.weight"]
    assert "kept in float" in summary.requantized[0]
    model, _ = load(tmp_path / "ct", torch.float32)
    state = model.state_dict()
    assert torch.equal(state["model.embed_tokens.weight"], ours["model.embed_tokens.weight"].dequantize().float())
    if isinstance(ours.get("lm_head.weight"), AOQTensor):
        assert torch.equal(state["lm_head.weight"], ours["lm_head.weight"].dequantize(torch.float32))


def test_sharded_export_and_convert_through_the_command_line(float_dir, tmp_path, capsys):
    src = quantized(float_dir, tmp_path, RECIPES["int4_g32"])
    out, back = tmp_path / "ct", tmp_path / "back"
    assert cli_main(["export", str(src), str(out), "--format", "compressed-tensors", "--max-shard-size", "100KB"]) == 0
    printed = capsys.readouterr()
    assert "14 x pack-quantized int4 group 32, weight-only" in printed.out
    assert "export: 100%" in printed.err  # transformers-style progress, one step per tensor
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "model.layers.0.self_attn.q_proj.weight_packed" in index["weight_map"]
    _, got = load(out)
    ours = load_checkpoint(src)
    assert torch.equal(got, float_model_with(float_dir, ours))
    assert cli_main(["convert", str(out), str(back)]) == 0
    printed = capsys.readouterr()
    assert "-> Int4Tensor" in printed.out and "convert: 100%" in printed.err
    again = load_checkpoint(back)
    for name, t in ours.items():
        if isinstance(t, AOQTensor):
            assert_same_tensor(t, again[name], name)
    assert cli_main(["convert", str(out), str(back)]) == 2  # exists
    assert "already exists" in capsys.readouterr().err


def test_convert_refuses_tensors_its_scheme_does_not_have(float_dir, tmp_path):
    """A stored tensor the module's scheme has no place for (a static input scale) is refused,
    never dropped."""
    from safetensors.torch import load_file, save_file

    src = quantized(float_dir, tmp_path, RECIPES["fp8"])
    out = tmp_path / "ct"
    export_checkpoint(src, out)
    stored = load_file(out / "model.safetensors")
    stored["model.layers.1.mlp.up_proj.input_scale"] = torch.ones(1)
    save_file(stored, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ExportError, match=r"model\.layers\.1\.mlp\.up_proj: stored tensors \['input_scale'\]"):
        convert_checkpoint(out, tmp_path / "back")
    assert not (tmp_path / "back").exists()


def test_fused_layers_with_different_schemes_are_noted(float_dir, tmp_path):
    recipe = FqnToConfig({"re:.*q_proj": Int4WeightOnlyConfig(group_size=32, symmetric=True),
                          "_default": Int8WeightOnlyConfig()})
    summary = export_checkpoint(quantized(float_dir, tmp_path, recipe), tmp_path / "ct")
    text = summary.format_text()
    assert "note: model.layers.0.self_attn: q_proj, k_proj, v_proj have different schemes" in text
    assert "mlp" not in "".join(summary.notes)
    plain = export_checkpoint(quantized(float_dir, tmp_path / "b", RECIPES["int8"]), tmp_path / "ct2")
    assert plain.notes == []
