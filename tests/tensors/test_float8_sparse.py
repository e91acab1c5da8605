"""Float8SemiSparseTensor (2:4 sparse float8) against slow references written here from the
layout in docs/format.md (pruning, position bytes, values), the loader's refusals, and every path
the other tensor types take (configs, schemes, save/reload, from_pretrained, inspect)."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hf_aoq
from hf_aoq import AOQError, FormatError, FqnToConfig, Float8Tensor, PerRow, quantize_, serialization
from hf_aoq.configs import Float8DynamicActivationFloat8SemiSparseWeightConfig as SparseConfig
from hf_aoq.configs import config_for_scheme, recipe_from_dict, recipe_to_dict
from hf_aoq.tensors.float8_sparse import Float8SemiSparseTensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# ---------------------------------------------------------------------- references
def ref_prune(w: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, per group of 4: the two kept positions, by (magnitude desc, position asc), sorted."""
    out = []
    for row in w.float().tolist():
        groups = []
        for g in range(len(row) // 4):
            vals = row[4 * g:4 * g + 4]
            order = sorted(range(4), key=lambda i: (-abs(vals[i]), i))
            groups.append(tuple(sorted(order[:2])))
        out.append(groups)
    return out


def ref_position_bytes(kept: list[list[tuple[int, int]]]) -> list[list[int]]:
    """docs/format.md: value j's position in bits 2(j % 4), 2(j % 4) + 1 of byte j // 4."""
    out = []
    for groups in kept:
        flat = [p for pair in groups for p in pair]
        nbytes = -(-len(flat) // 4)
        row = [0] * nbytes
        for j, p in enumerate(flat):
            row[j // 4] |= p << (2 * (j % 4))
        out.append(row)
    return out


def ref_dense(t: Float8SemiSparseTensor) -> torch.Tensor:
    """The float32 weight, value by value: w[n, 4g + pos] = float(value) * scale[n]."""
    n, k = t.shape
    w = torch.zeros(n, k)
    q = t.qdata.float()
    for r in range(n):
        for j in range(k // 2):
            pos = (int(t.positions[r, j // 4]) >> (2 * (j % 4))) & 3
            w[r, 4 * (j // 2) + pos] = q[r, j] * t.scale[r, 0]
    return w


def tied_weight(n=6, k=40, seed=0):
    """Small integers: many equal magnitudes (ties) and zeros in every row."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-3, 4, (n, k), generator=g).float() / 4)


# ---------------------------------------------------------------------- the format
@pytest.mark.parametrize("k", [4, 8, 12, 40, 64, 100])
def test_pruning_and_positions_match_the_reference(k):
    for w in (tied_weight(6, k, seed=k), torch.randn(5, k, generator=torch.Generator().manual_seed(k))):
        t = Float8SemiSparseTensor.from_float(w)
        kept = ref_prune(w)
        assert t.positions.tolist() == ref_position_bytes(kept)
        # The kept values are the weight's at those positions, quantized as Float8Tensor would.
        cols = [[4 * g + p for g, pair in enumerate(groups) for p in pair] for groups in kept]
        values = torch.stack([w[r, c] for r, c in enumerate(cols)])
        assert torch.equal(t.qdata.float(), (values / t.scale).clamp(-448, 448).to(E4M3).float())


def test_ties_go_to_the_lower_position():
    # Row abs-max 3.5: scale 2^-7, every value here exact in e4m3.
    w = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, -2.0, 2.0, 2.0, -1.0, 0.5, -3.5, 0.5, 0.5]])
    t = Float8SemiSparseTensor.from_float(w)
    # Every group keeps (0, 1): four equal, four zeros, |-2| = |2| = |2| (the two lower win), and
    # -3.5 at 1 with the first of three equal 0.5s.
    assert ref_prune(w) == [[(0, 1), (0, 1), (0, 1), (0, 1)]]
    assert torch.equal(t.dequantize(), torch.tensor([[1.0, 1, 0, 0, 0, 0, 0, 0, -2, 2, 0, 0, 0.5, -3.5, 0, 0]]))


def test_values_and_scale_are_float8_tensor_of_the_pruned_weight():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    t = Float8SemiSparseTensor.from_float(w)
    pruned = torch.where(t.dequantize() != 0, w, torch.zeros_like(w))
    dense = Float8Tensor.from_float(pruned, E4M3, PerRow())
    assert torch.equal(t.scale, dense.scale)
    assert torch.equal(t.dequantize(), dense.dequantize())
    assert torch.equal(t.dequantize(torch.float32), ref_dense(t))


def test_dequantize_has_exactly_two_nonzeros_per_four():
    g = torch.Generator().manual_seed(2)
    w = (torch.rand(32, 96, generator=g) * 0.5 + 0.5) * torch.sign(torch.randn(32, 96, generator=g))
    d = Float8SemiSparseTensor.from_float(w).dequantize()
    assert ((d.reshape(32, -1, 4) != 0).sum(-1) == 2).all()
    # Never more than two, whatever the weight (zeros and ties included).
    d = Float8SemiSparseTensor.from_float(tied_weight(8, 64)).dequantize()
    assert ((d.reshape(8, -1, 4) != 0).sum(-1) <= 2).all()


def test_odd_number_of_groups_pads_the_last_byte_with_zero():
    t = Float8SemiSparseTensor.from_float(torch.randn(3, 36))  # 9 groups: 18 values, 5 bytes
    assert t.qdata.shape == (3, 18) and t.positions.shape == (3, 5)
    assert ((t.positions[:, -1] >> 4) == 0).all()


def test_bad_input_is_refused():
    with pytest.raises(AOQError, match="multiple of 4"):
        Float8SemiSparseTensor.from_float(torch.randn(4, 30), name="w")
    with pytest.raises(AOQError, match="float8_e4m3fn values only"):
        Float8SemiSparseTensor.from_float(torch.randn(4, 32), weight_dtype=E5M2, name="w")
    with pytest.raises(AOQError, match="act_quant"):
        Float8SemiSparseTensor.from_float(torch.randn(4, 32), act_quant="per_tensor", name="w")
    with pytest.raises(AOQError, match="inf or nan"):
        Float8SemiSparseTensor.from_float(torch.tensor([[1.0, float("nan"), 0.0, 0.0]]), name="w")
    with pytest.raises(AOQError, match="2-D"):
        Float8SemiSparseTensor.from_float(torch.randn(8), name="w")


# ---------------------------------------------------------------------- save, reload, refuse
def roundtrip(sd):
    tensors, metadata = serialization.flatten_state_dict(sd)
    return serialization.unflatten_state_dict(tensors, metadata), tensors, metadata


@pytest.mark.parametrize("shape", [(16, 64), (8, 36), (3, 8, 24)])
def test_save_reload_is_bit_exact(shape, tmp_path):
    w = torch.randn(*shape).to(torch.bfloat16)
    t = Float8SemiSparseTensor.from_float(w)
    path = tmp_path / "w.safetensors"
    serialization.save_file({"w": t, "b": torch.ones(3)}, str(path))
    back = serialization.load_file(str(path))["w"]
    assert type(back) is Float8SemiSparseTensor and back.attributes() == t.attributes()
    for n, f in t.tensor_fields().items():
        assert torch.equal(getattr(back, n).view(torch.uint8), f.view(torch.uint8)), n
    assert torch.equal(back.dequantize(), t.dequantize())


def test_experts_are_each_experts_2d_tensor():
    w = torch.randn(3, 8, 32)
    t = Float8SemiSparseTensor.from_float(w)
    assert t.shape == (3, 8, 32) and t.positions.shape == (3, 8, 4) and t.block_size == (1, 1, 32)
    for e in range(3):
        assert torch.equal(t.dequantize()[e], Float8SemiSparseTensor.from_float(w[e]).dequantize())
        assert torch.equal(t[e].dequantize(), t.dequantize()[e])


def corrupt_positions(t, fn):
    sd, tensors, metadata = roundtrip({"model.w": t})
    key = next(k for k in tensors if k.endswith("positions"))
    tensors = dict(tensors)
    tensors[key] = fn(tensors[key].clone())
    return tensors, metadata


@pytest.mark.parametrize("nibble, what", [(0b0101, r"\(1, 1\)"), (0b0111, r"\(3, 1\)"), (0b0000, r"\(0, 0\)")])
def test_malformed_positions_are_refused_at_load(nibble, what):
    t = Float8SemiSparseTensor.from_float(torch.randn(4, 64))

    def bad(p):
        p[2, 1] = (p[2, 1] & 0x0F) | (nibble << 4)  # row 2, group 3
        return p

    tensors, metadata = corrupt_positions(t, bad)
    with pytest.raises(FormatError, match=rf"tensor 'model.w', field 'positions': row 2, group 3 .*keeps positions "
                                          rf"{what}.*increasing"):
        serialization.unflatten_state_dict(tensors, metadata)


def test_a_nonzero_pad_nibble_is_refused_at_load():
    t = Float8SemiSparseTensor.from_float(torch.randn(4, 36))

    def bad(p):
        p[1, -1] |= 0x40
        return p

    tensors, metadata = corrupt_positions(t, bad)
    with pytest.raises(FormatError, match=r"tensor 'model.w', field 'positions': row 1: the last byte's high nibble"):
        serialization.unflatten_state_dict(tensors, metadata)


@pytest.mark.parametrize("change, match", [
    (dict(qdata=torch.zeros(4, 32, dtype=E5M2)), "field 'qdata'"),
    (dict(qdata=torch.zeros(4, 64, dtype=E4M3)), "field 'qdata'"),
    (dict(qdata=torch.full((4, 32), 0x7F, dtype=torch.uint8).view(E4M3)),
     r"field 'qdata': 128 float8_e4m3fn codes are NaN \(the first at \(0, 0\)\)"),
    (dict(positions=torch.zeros(4, 9, dtype=torch.uint8)), "field 'positions'"),
    (dict(scale=torch.ones(4, 1, dtype=torch.bfloat16)), "field 'scale'"),
    (dict(scale=torch.zeros(4, 1)), "field 'scale'"),
    (dict(block_size=(4, 64)), "attribute 'block_size'"),
    (dict(shape=(4, 62)), "attribute 'shape'"),
    (dict(act_quant="per_tensor"), "attribute 'act_quant'"),
    (dict(act_quant=None, act_dtype=E4M3), "attribute 'act_dtype'"),
])
def test_loader_refuses_fields_that_contradict_the_attributes(change, match):
    t = Float8SemiSparseTensor.from_float(torch.randn(4, 64))
    with pytest.raises(AOQError, match=match):
        Float8SemiSparseTensor.check_fields(dict(t.fields(), **change))


# ---------------------------------------------------------------------- ops
def test_slices_rows_and_shards():
    w = torch.randn(10, 48)
    t = Float8SemiSparseTensor.from_float(w)
    d = t.dequantize()
    assert torch.equal(t[2:5].dequantize(), d[2:5])
    assert torch.equal(t[:, 8:40].dequantize(), d[:, 8:40])
    assert torch.equal(t[:, 16:].dequantize(), d[:, 16:])
    with pytest.raises(AOQError, match="align"):
        t[:, 4:]
    idx = torch.tensor([[3, 0], [9, 3]])
    assert torch.equal(F.embedding(idx, t), F.embedding(idx, d))
    assert torch.equal(torch.cat([t[:, :24], t[:, 24:]], dim=1).dequantize(), d)
    assert torch.equal(torch.cat(list(t.chunk(2, dim=0))).dequantize(), d)


def test_linear_is_the_reference_with_float8_tensors_activation_quantization():
    w = torch.randn(24, 64).to(torch.bfloat16)
    x = torch.randn(3, 64).to(torch.bfloat16)
    t = Float8SemiSparseTensor.from_float(w)
    dense = Float8Tensor.from_float(w, E4M3, PerRow(), act_quant="per_row")
    assert torch.equal(t.simulate_input_quantization(x), dense.simulate_input_quantization(x))
    e5 = Float8SemiSparseTensor.from_float(w, act_dtype=E5M2)
    assert torch.equal(e5.simulate_input_quantization(x),
                       Float8Tensor.from_float(w, act_quant="per_row", act_dtype=E5M2).simulate_input_quantization(x))


# ---------------------------------------------------------------------- configs and schemes
class CutlassSemiSparseLayout:  # stands in for torchao's layout object (matched by class name only)
    pass


def test_config_takes_torchaos_fields_and_refuses_others():
    c = SparseConfig()
    assert (c.layout, c.activation_dtype, c.weight_dtype) == ("CutlassSemiSparseLayout", E5M2, E4M3)
    assert SparseConfig(layout=CutlassSemiSparseLayout()) == c
    assert recipe_from_dict(recipe_to_dict(c)) == c
    with pytest.raises(AOQError, match="layout must be one of"):
        SparseConfig(layout="SemiSparseLayout")
    with pytest.raises(AOQError, match="layout must be one of"):
        SparseConfig(layout=SimpleNamespace())
    with pytest.raises(AOQError, match="weight_dtype must be torch.float8_e4m3fn"):
        SparseConfig(weight_dtype=E5M2)
    with pytest.raises(AOQError, match="activation_dtype"):
        SparseConfig(activation_dtype=torch.bfloat16)
    with pytest.raises(FormatError, match="no field"):
        recipe_from_dict({"type": "Float8DynamicActivationFloat8SemiSparseWeightConfig", "granularity": None})


def test_scheme_fp8_sparse():
    assert config_for_scheme("fp8-sparse") == SparseConfig(activation_dtype=E4M3)
    with pytest.raises(AOQError, match="no group size"):
        config_for_scheme("fp8-sparse", 32)


def tiny_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 32)).to(torch.bfloat16)


def test_quantize_fqn_to_config_and_compile():
    m = tiny_mlp()
    quantize_(m, FqnToConfig({"0": config_for_scheme("fp8-sparse"), "_default": hf_aoq.Int8WeightOnlyConfig()}))
    w0 = m[0].weight
    assert isinstance(w0, Float8SemiSparseTensor) and w0.act_dtype == E4M3 and w0.act_quant == "per_row"
    assert isinstance(m[2].weight, hf_aoq.Int8Tensor)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        eager = m(x)
        compiled = torch.compile(m, backend="inductor", fullgraph=True)
        torch.testing.assert_close(compiled(x), eager, rtol=2**-6, atol=2**-6)


def test_from_pretrained_quantizes_on_load_and_reloads_bit_exact(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    config = hf_aoq.AOQConfig(quant_type=SparseConfig())
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=config)
    w = model.model.layers[0].mlp.up_proj.weight
    assert isinstance(w, Float8SemiSparseTensor) and w.act_dtype == E5M2
    ids = torch.tensor([[3, 4, 5, 6]])
    logits = model(ids).logits
    model.save_pretrained(tmp_path / "sparse")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "sparse")
    w2 = again.model.layers[0].mlp.up_proj.weight
    assert isinstance(w2, Float8SemiSparseTensor)
    assert torch.equal(w2.qdata.view(torch.uint8), w.qdata.view(torch.uint8)) and torch.equal(w2.positions, w.positions)
    assert torch.equal(again(ids).logits, logits)


def test_cli_quantize_inspect_and_card(tiny_llama_dir, tmp_path, capsys):
    from hf_aoq import cli

    out = tmp_path / "fp8-sparse"
    assert cli.main(["quantize", str(tiny_llama_dir), "--scheme", "fp8-sparse", "--out", str(out)]) == 0
    assert cli.main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^model.layers.0.mlp.up_proj.weight\s+fp8-sparse 2:4 e4m3 per-row dyn-act per_row e4m3\s+256x128\s",
                     text, re.M), text
    assert text.rstrip().endswith("every tensor loads: yes")
    card = (out / "README.md").read_text()
    assert "fp8-sparse 2:4 e4m3" in card and "- fp8-sparse" in card
