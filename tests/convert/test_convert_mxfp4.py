"""`hf-aoq convert` on transformers' Mxfp4 checkpoints (gpt-oss): `*_blocks` / `*_scales` become
MXTensor experts whose every value is transformers' own dequantization (`convert_moe_packed_tensors`)
of the same bytes; the converted tiny GptOss loads with from_pretrained, runs its experts on
hf_aoq's MXFP4 kernels and gives the logits of transformers' dequantized model.

transformers cannot write Mxfp4 on CPU (its quantizer needs the Triton kernels from the Hub), so
the checkpoint is written here from the published layout (hf_aoq/convert/mxfp4.py)."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import hf_aoq
from hf_aoq import cli
from hf_aoq.convert.mxfp4 import Mxfp4ConversionError, dequantize_as_transformers, mx_from_blocks
from hf_aoq.core.errors import FormatError
from hf_aoq.serialization import open_checkpoint
from hf_aoq.tensors import MXTensor
from hf_aoq.tensors.experts import TransposedExperts
from hf_aoq.workflows import ExportError, convert_checkpoint

VOCAB = 256
EXPERTS = ("gate_up_proj", "down_proj")


def gpt_oss_config(**extra):
    return GptOssConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        vocab_size=VOCAB, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                        head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"], **extra)


def packed(shape_ekn, seed: int):
    """Random Mxfp4 bytes for a transformers parameter [E, K, N]: blocks [E, N, K/32, 16] and
    scales [E, N, K/32] near 2^-4 (so that the tiny model's activations stay moderate)."""
    g = torch.Generator().manual_seed(seed)
    e, k, n = shape_ekn
    blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(119, 125, (e, n, k // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def write_mxfp4_checkpoint(path, dtype="float32"):
    torch.manual_seed(0)
    config = gpt_oss_config()
    model = GptOssForCausalLM(config)
    with torch.no_grad():  # gpt-oss initializes its router and expert biases to zero
        for n, p in model.named_parameters():
            if p.abs().max() == 0 and "norm" not in n:
                p.normal_(0, 0.02)
    tensors = {}
    for i, (k, v) in enumerate(model.state_dict().items()):
        if k.endswith(EXPERTS) and ".experts." in k:
            tensors[k + "_blocks"], tensors[k + "_scales"] = packed(v.shape, i)
        else:
            tensors[k] = v.contiguous()
    path.mkdir()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    config.dtype = dtype
    config.save_pretrained(path)
    return tensors


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mxfp4") / "gpt-oss-mxfp4"
    write_mxfp4_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def converted(mxfp4_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("aoq") / "gpt-oss-aoq"
    summary = convert_checkpoint(mxfp4_dir, out)
    return out, summary


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def transformers_dequantized(path, **kwargs):
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True), **kwargs)


# ---------------------------------------------------------------------- the layout, bit for bit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_byte_and_scale_decodes_to_transformers_dequantization(dtype):
    """All 256 bytes (both nibbles of every code) under every finite e8m0 code 0..254, in
    blocks of 16 bytes: MXTensor's values, transposed to transformers' [E, K, N], equal
    convert_moe_packed_tensors bit for bit (infinities included where the dtype overflows)."""
    codes = torch.arange(255, dtype=torch.uint8)
    blocks = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16)  # 16 blocks, every byte once
    blocks = blocks.expand(255, 16, 16).reshape(1, 255, 16, 16).contiguous()  # [E=1, N=255, K/32=16, 16]
    scales = codes.reshape(1, 255, 1).expand(1, 255, 16).contiguous()
    t = mx_from_blocks(blocks, scales, dtype, "w")
    assert isinstance(t, MXTensor) and t.shape == (1, 255, 512) and t.elem_dtype == torch.float4_e2m1fn_x2
    MXTensor.check_fields(t.fields())
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    got = t.dequantize().transpose(1, 2)
    assert got.dtype == want.dtype and got.shape == want.shape == (1, 512, 255)
    assert torch.equal(got.view(torch.int16 if dtype.itemsize == 2 else torch.int32),
                       want.view(torch.int16 if dtype.itemsize == 2 else torch.int32))
    assert torch.equal(dequantize_as_transformers(blocks, scales, dtype), want)


def test_the_low_nibble_is_the_even_element_and_the_scale_is_e8m0_with_bias_127():
    blocks = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0, 0] = 0x72  # element 0: code 2 (1.0), element 1: code 7 (6.0)
    scales = torch.full((1, 1, 1), 129, dtype=torch.uint8)  # 2^2
    w = mx_from_blocks(blocks, scales, torch.float32, "w").dequantize()
    assert w[0, 0, :3].tolist() == [4.0, 24.0, 0.0]


# ---------------------------------------------------------------------- convert, load, run
def test_convert_detects_mxfp4_and_stores_mxtensor_experts(mxfp4_dir, converted):
    out, summary = converted
    assert summary.groups == {"Mxfp4 down_proj (e2m1, e8m0 scale per 32) -> MXTensor mxfp4": 2,
                              "Mxfp4 gate_up_proj (e2m1, e8m0 scale per 32) -> MXTensor mxfp4": 2}
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    names = [f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("down_proj", "gate_up_proj")]
    assert qc["quant_method"] == "aoq" and qc["stored_transposed"] == names
    state = open_checkpoint(out).state_dict()
    raw = load_file(mxfp4_dir / "model.safetensors")
    for name in names:
        t = state[name]
        assert isinstance(t, MXTensor) and t.act_dtype is None and t.dtype == torch.float32
        assert torch.equal(t.qdata, raw[name + "_blocks"].reshape(t.qdata.shape))
        assert torch.equal(t.scale, raw[name + "_scales"])
        want = convert_moe_packed_tensors(raw[name + "_blocks"], raw[name + "_scales"], dtype=torch.float32)
        assert torch.equal(t.dequantize().transpose(1, 2), want)
    plain = {k for k in raw if not k.endswith(("_blocks", "_scales"))}
    assert {k for k, v in state.items() if not isinstance(v, MXTensor)} == plain
    assert all(torch.equal(state[k], raw[k]) for k in plain)
    assert (out / "README.md").is_file()


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm", "eager"])
def test_the_converted_model_gives_transformers_dequantized_logits(mxfp4_dir, converted, ids, impl, monkeypatch):
    """Every experts implementation of gpt-oss: the experts hold the transposed view of the
    MXTensor; grouped_mm and batched_mm run each expert as a linear on hf_aoq's MXFP4 GEMV (few
    rows), which computes in float32 on the exact weight, as transformers' float32 model does."""
    from hf_aoq.kernels import cpu_ext, cpu_mx

    out, _ = converted
    calls = []
    original = cpu_mx.mx_linear_io
    monkeypatch.setattr(cpu_mx, "mx_linear_io", lambda *a: calls.append(1) or original(*a))
    ref = transformers_dequantized(mxfp4_dir, experts_implementation=impl)
    model = AutoModelForCausalLM.from_pretrained(out, experts_implementation=impl)
    w = model.model.layers[0].mlp.experts.gate_up_proj
    assert isinstance(w, TransposedExperts) and isinstance(w.experts, MXTensor) and w.shape == (4, 64, 128)
    got, want = logits(model, ids), logits(ref, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    if impl != "eager" and cpu_ext.available():
        assert calls, "the experts did not run on the MXFP4 kernel"


def test_save_reload_and_dequantize(mxfp4_dir, converted, ids, tmp_path):
    out, _ = converted
    model = AutoModelForCausalLM.from_pretrained(out)
    model.save_pretrained(tmp_path / "again")
    qc = json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"]
    assert len(qc["stored_transposed"]) == 4
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    assert torch.equal(logits(again, ids), logits(model, ids))
    a, b = open_checkpoint(out).state_dict(), open_checkpoint(tmp_path / "again").state_dict()
    name = "model.layers.1.mlp.experts.down_proj"
    assert torch.equal(a[name].qdata, b[name].qdata) and torch.equal(a[name].scale, b[name].scale)
    ref = transformers_dequantized(mxfp4_dir)
    floats = AutoModelForCausalLM.from_pretrained(out, quantization_config=hf_aoq.AOQConfig(dequantize=True))
    for p in ("gate_up_proj", "down_proj"):
        got = getattr(floats.model.layers[0].mlp.experts, p)
        assert type(got) is torch.nn.Parameter and torch.equal(got, getattr(ref.model.layers[0].mlp.experts, p))
    model.dequantize()
    assert type(model.model.layers[1].mlp.experts.down_proj) is torch.nn.Parameter
    torch.testing.assert_close(logits(model, ids), logits(ref, ids), rtol=1e-4, atol=1e-5)


def test_the_cli_converts_it(mxfp4_dir, tmp_path, capsys):
    assert cli.main(["convert", str(mxfp4_dir), str(tmp_path / "o")]) == 0
    assert "MXTensor mxfp4" in capsys.readouterr().out
    bad = _broken(tmp_path / "bad", lambda t: t.pop("model.layers.0.mlp.experts.down_proj_scales"))
    assert cli.main(["convert", str(bad), str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert "down_proj_blocks has no model.layers.0.mlp.experts.down_proj_scales" in err and "Traceback" not in err
    assert not (tmp_path / "o2").exists()


# ---------------------------------------------------------------------- bad input
def _broken(tmp_path, edit):
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "src"
    tensors = write_mxfp4_checkpoint(path)
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


G = "model.layers.1.mlp.experts.gate_up_proj"


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop(G + "_scales"), f"{G}_blocks has no {G}_scales"),
    (lambda t: t.pop(G + "_blocks"), f"{G}_scales has no {G}_blocks"),
    (lambda t: t.update({G + "_scales": t[G + "_scales"][:, :, :1].contiguous()}),
     f"{G}_scales: shape (4, 128, 1) does not match {G}_blocks (4, 128, 2, 16)"),
    (lambda t: t.update({G + "_blocks": t[G + "_blocks"][..., :8].contiguous()}), f"{G}_blocks: shape (4, 128, 2, 8)"),
    (lambda t: t.update({G + "_scales": t[G + "_scales"].to(torch.int16)}), f"{G}_scales: dtype torch.int16"),
    (lambda t: t[G + "_scales"].__setitem__((0, 3, 1), 255), f"{G}_scales: holds the e8m0 code 255"),
])
def test_a_malformed_pair_is_refused_naming_the_tensor(tmp_path, edit, message):
    src = _broken(tmp_path, edit)
    with pytest.raises(ExportError, match="nothing was written") as e:
        convert_checkpoint(src, tmp_path / "out")
    assert message in str(e.value)
    assert not (tmp_path / "out").exists()


def test_stored_transposed_must_name_stored_tensors(converted, tmp_path):
    import shutil

    out, _ = converted
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"]["stored_transposed"].append("model.layers.0.mlp.router.weight")
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(FormatError, match="stored_transposed names 'model.layers.0.mlp.router.weight'"):
        AutoModelForCausalLM.from_pretrained(copy)


def test_aoq_config_round_trips_stored_transposed():
    config = hf_aoq.AOQConfig(hf_aoq.Int8WeightOnlyConfig(), stored_transposed=["b.w", "a.w"])
    d = config.to_dict()
    assert d["stored_transposed"] == ["a.w", "b.w"]
    assert hf_aoq.AOQConfig.from_dict(d) == config
    assert "stored_transposed" not in hf_aoq.AOQConfig(hf_aoq.Int8WeightOnlyConfig()).to_dict()
    with pytest.raises(FormatError, match="stored_transposed"):
        hf_aoq.AOQConfig.from_dict(dict(d, stored_transposed="a.w"))


def test_the_transposed_view_indexes_like_the_float_parameter():
    """gpt-oss's forwards index the [E, in, out] parameter: one expert (eager: the 2-D view of that
    expert, which x @ runs as a linear), or a 1-D list of experts (batched_mm: still a quantized view)."""
    blocks, scales = packed((3, 64, 32), 5)
    t = mx_from_blocks(blocks, scales, torch.bfloat16, "w")
    view = TransposedExperts(t)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [3, 64, 32]
    assert view.shape == want.shape
    for index in (1, torch.tensor(2), torch.tensor(0, dtype=torch.int32)):
        got = view[index]
        assert isinstance(got, TransposedExperts) and got.shape == (64, 32) and torch.equal(got, want[int(index)])
    gathered = view[torch.tensor([2, 0, 2])]
    assert isinstance(gathered, TransposedExperts) and gathered.shape == (3, 64, 32)
    assert torch.equal(gathered.experts.dequantize().transpose(1, 2), want[[2, 0, 2]])


def test_module_to_dtype_moves_the_tensor_under_the_view(mxfp4_dir, converted, ids):
    out, _ = converted
    model = AutoModelForCausalLM.from_pretrained(out).to(torch.bfloat16)
    w = model.model.layers[0].mlp.experts.down_proj
    assert isinstance(w, TransposedExperts) and w.dtype == w.experts.dtype == torch.bfloat16
    assert isinstance(w.experts, MXTensor)
    ref = transformers_dequantized(mxfp4_dir).to(torch.bfloat16)  # the same casts of everything else
    assert torch.equal(logits(model, ids), logits(ref, ids))  # measured equal in bf16 on this tiny model


def test_torch_compile_runs_the_converted_model(converted, ids):
    out, _ = converted
    torch._dynamo.reset()
    model = AutoModelForCausalLM.from_pretrained(out)
    want = logits(model, ids[:1, :8])
    with torch.no_grad():
        got = torch.compile(model)(ids[:1, :8]).logits
    torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_sharded_source_with_blocks_and_scales_in_different_shards_converts(mxfp4_dir, converted, tmp_path):
    """As gpt-oss ships: shards and an index (a pair may straddle two shards)."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(mxfp4_dir, src)
    data = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    keys = sorted(data)
    weight_map = {}
    for i, names in enumerate((keys[::2], keys[1::2]), 1):
        shard = f"model-0000{i}-of-00002.safetensors"
        save_file({k: data[k] for k in names}, src / shard, metadata={"format": "pt"})
        weight_map.update({k: shard for k in names})
    assert weight_map[G + "_blocks"] != weight_map[G + "_scales"]
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    summary = convert_checkpoint(src, tmp_path / "out", max_shard_size=100_000)
    assert sum(summary.groups.values()) == 4 and not any(f.startswith("model-") for f in summary.copied)
    one, two = open_checkpoint(converted[0]).state_dict(), open_checkpoint(tmp_path / "out").state_dict()
    assert one.keys() == two.keys()
    for k in one:
        a, b = one[k], two[k]
        assert torch.equal(a.qdata, b.qdata) and torch.equal(a.scale, b.scale) if isinstance(a, MXTensor) \
            else torch.equal(a, b)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()  # sharded at 100 kB
