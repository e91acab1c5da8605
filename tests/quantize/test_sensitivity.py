"""The sensitivity report (hf_aoq.sensitivity): candidates by name, what it measures per weight,
its loss estimate against exact one-weight swaps, its memory bound, JSON, and `hf-aoq analyze`."""
import dataclasses
import gc
import json
import math
import weakref

import pytest
import torch

from hf_aoq import AOQError, FormatError, Int4DQWeightOnlyConfig, Int8WeightOnlyConfig, Int4WeightOnlyConfig, cli
from hf_aoq.configs import AOQBaseConfig
from hf_aoq.sensitivity import (
    SensitivityReport,
    exact_loss_deltas,
    mean_loss,
    parse_candidates,
    sensitivity,
)

from conftest import sqnr
from models import markov_tokens, tiny_llama, trained_tiny_model


@pytest.fixture(scope="module")
def trained():
    return trained_tiny_model(30)


@pytest.fixture(scope="module")
def calibration():
    return [markov_tokens(8, 65, seed=2)]


def test_candidates_are_scheme_names_with_an_optional_group_size():
    c = parse_candidates("int4, int4-plain:g32,int8,int4:g64,bf16")
    assert [x.name for x in c] == ["int4", "int4-plain:g32", "int8", "int4:g64", "bf16"]
    assert c[0].config == Int4DQWeightOnlyConfig(32) and c[1].config == Int4WeightOnlyConfig(32)
    assert c[2].config == Int8WeightOnlyConfig() and c[3].config == Int4DQWeightOnlyConfig(64) and c[4].config is None
    assert parse_candidates([Int8WeightOnlyConfig(64)])[0].config == Int8WeightOnlyConfig(64)
    with pytest.raises(AOQError, match="unknown scheme 'int9'"):
        parse_candidates("int9")
    with pytest.raises(AOQError, match=":g<N>"):
        parse_candidates("int4-plain:32")
    with pytest.raises(AOQError, match="repeat"):
        parse_candidates("int8,int8")
    with pytest.raises(AOQError, match="at least one"):
        parse_candidates("")


def test_every_linear_and_embedding_is_measured_with_its_own_bytes_and_errors():
    model = tiny_llama(tie=True)
    ids = torch.randint(3, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    report = sensitivity(model, "int4,int8,bf16", [ids])
    names = {l.name for l in report.layers}
    linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    # The tied embedding and lm_head are one tensor: measured once, through both readers.
    assert names == linears | {"model.embed_tokens.weight"}
    embed = report.layer("lm_head.weight")
    assert embed.name == "model.embed_tokens.weight" and embed.tied == ("lm_head.weight",) and embed.kind == "embedding"
    assert report.tokens == 64 and math.isclose(report.base_loss, mean_loss(model, [ids]), rel_tol=1e-3)
    for layer in report.layers:
        w = model.get_parameter(layer.name)
        q = Int4DQWeightOnlyConfig().quantize_weight(w)
        m4, m8, mf = (layer.results[k] for k in ("int4", "int8", "bf16"))
        assert m4.nbytes == sum(t.numel() * t.element_size() for t in q.tensor_fields().values())
        assert m4.bits == pytest.approx(8 * m4.nbytes / w.numel())
        assert m4.weight_sqnr_db == pytest.approx(sqnr(w, q.dequantize()), abs=0.05)
        assert 10 < m4.output_sqnr_db < m8.output_sqnr_db < math.inf
        assert 0 <= m8.loss_delta < m4.loss_delta
        assert mf.bits == 16 and mf.loss_delta == 0 and mf.weight_sqnr_db == math.inf


def test_the_gradient_terms_predict_an_exact_one_weight_swap(trained, calibration):
    """first order + Fisher is the second-order Taylor expansion: for int8 (a small change) it
    must match the exact loss change of quantizing only that weight."""
    report = sensitivity(trained, "int8,int4", calibration, exact=len(list(trained.parameters())))
    assert report.base_loss < math.log(128) - 2  # a trained model, far below uniform guessing
    for layer in report.layers:
        m = layer.results["int8"]
        assert m.exact_delta is not None
        assert abs(m.first_order + m.loss_delta - m.exact_delta) <= 0.15 * abs(m.exact_delta) + 2e-5, layer.name
    # The most sensitive weights under int4 are found: the embedding and the head lose most.
    worst = sorted(report.layers, key=lambda l: l.results["int4"].loss_delta, reverse=True)[:2]
    assert {l.name for l in worst} == {"embed.weight", "head.weight"}


def test_at_most_one_quantized_copy_of_a_weight_is_alive(trained, calibration):
    live: list[weakref.ref] = []
    most = [0]

    @dataclasses.dataclass(frozen=True)
    class Counting(AOQBaseConfig):
        def quantize_weight(self, weight, *, name="weight"):
            gc.collect()
            alive = sum(r() is not None for r in live)
            most[0] = max(most[0], alive)
            q = Int8WeightOnlyConfig().quantize_weight(weight, name=name)
            live.append(weakref.ref(q))
            return q

    sensitivity(trained, [Counting()], calibration)
    assert len(live) == 8 and most[0] == 0  # each made, measured and dropped before the next


def test_the_report_ranks_worst_first_and_round_trips_as_json(trained, calibration, tmp_path):
    report = sensitivity(trained, "int4,int4-plain:g128,int8", calibration, exact=1)
    table = report.table(top=3).splitlines()
    assert table[0].split()[:2] == ["weight", "scheme"] and len(table) == 1 + 3 * 3
    assert table[1].split()[0] == max(report.layers, key=lambda l: l.worst()).name
    path = tmp_path / "r.json"
    report.save(path)
    again = SensitivityReport.from_dict(json.loads(path.read_text()))
    assert again.to_dict() == report.to_dict() and not list(tmp_path.glob(".*tmp"))
    data = json.loads(path.read_text())
    data["version"] = 99
    with pytest.raises(FormatError, match="version 99"):
        SensitivityReport.from_dict(data)
    with pytest.raises(FormatError, match="not a sensitivity report"):
        SensitivityReport.from_dict({"version": 1})


def test_bad_input_is_named(trained, calibration):
    with pytest.raises(AOQError, match="at least one candidate that quantizes"):
        sensitivity(trained, "bf16", calibration)
    with pytest.raises(AOQError, match="needs the model's tokenizer"):
        sensitivity(trained, "int8", "some text")
    with pytest.raises(AOQError, match="no weight in scope"):
        sensitivity(trained, "int8", calibration, filter_fn=lambda m, n: False, include_embeddings=False)
    @dataclasses.dataclass(frozen=True)
    class OnlyWide(AOQBaseConfig):  # refuses narrow weights, as a group size that does not divide would
        def quantize_weight(self, weight, *, name="weight"):
            if weight.shape[1] < 128:
                raise AOQError(f"{name}: too narrow")
            return Int8WeightOnlyConfig().quantize_weight(weight, name=name)

    report = sensitivity(trained, ["int8", OnlyWide()], calibration, filter_fn=lambda m, n: "head" in n or "down" in n,
                         include_embeddings=False)
    assert [l.name for l in report.layers] == ["layers.0.down.weight", "layers.1.down.weight", "head.weight"]
    assert report.layer("head.weight").results[report.candidates[1].name] is None
    assert report.layer("layers.0.down.weight").results[report.candidates[1].name] is not None
    assert "does not fit" in report.table(None)
    with pytest.raises(AOQError, match="no weight named 'nope'"):
        exact_loss_deltas(trained, report, ["nope"], calibration)


def test_analyze_command_prints_the_table_and_writes_json(tiny_llama_dir, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{3 + (i * 7) % 500}" for i in range(300)))
    out = tmp_path / "report.json"
    rc = cli.main(["analyze", str(tiny_llama_dir), "--calibration", str(text), "--schemes", "int4,int8",
                   "--tokens", "128", "--top", "2", "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0 and "d loss (pred)" in printed and len([l for l in printed.splitlines() if " int8 " in l]) == 2
    data = json.loads(out.read_text())
    assert data["tokens"] == 128 and [c["name"] for c in data["candidates"]] == ["int4", "int8"]
    assert len(data["layers"]) == 2 * 7 + 2  # linears of two blocks, lm_head, the embedding
    assert cli.main(["analyze", str(tiny_llama_dir), "--calibration", str(tmp_path / "none.txt")]) == 2
    assert "no such text file" in capsys.readouterr().err
    assert cli.main(["analyze", str(tiny_llama_dir), "--calibration", str(text), "--schemes", "int9"]) == 2
    assert "unknown scheme 'int9'" in capsys.readouterr().err


def test_asymmetric_intx_candidates_are_scheme_names_with_a_group_size():
    """`int3-asym:g64`: the --scheme name int3-asym (IntxWeightOnlyConfig, mapping_type asymmetric)
    with :g<N>, as every other candidate; the quantized tensor carries a zero per group."""
    import torch

    from hf_aoq import IntxWeightOnlyConfig, PerGroup
    from hf_aoq.sensitivity import parse_candidate

    c = parse_candidate("int3-asym:g64")
    assert c.config == IntxWeightOnlyConfig(torch.int3, PerGroup(64), "asymmetric")
    assert parse_candidate("int3:g64").config.mapping_type == "symmetric"
    w = torch.randn(8, 128, dtype=torch.bfloat16) + 0.3
    q = c.config.quantize_weight(w)
    assert q.zero is not None
    bits = 8 * sum(t.numel() * t.element_size() for t in q.tensor_fields().values()) / w.numel()
    assert bits == 3.5  # 3 + (16 + 16) / 64
    with pytest.raises(AOQError, match="group size must be one of"):
        parse_candidate("int3-asym:g48")


def test_a_reference_weight_is_what_the_candidates_quantize(trained, calibration):
    """`reference`: the candidates quantize (and measure from) the given float weights while
    the model runs with its own; with the model's own weights it is the plain report."""
    import copy

    names = [n for n, _ in trained.named_parameters() if n.endswith("weight") and "norm" not in n]
    plain = sensitivity(trained, "int8,int4", calibration)
    same = sensitivity(trained, "int8,int4", calibration, reference={n: trained.get_parameter(n).detach() for n in names
                                                                     if n in {l.name for l in plain.layers}})
    assert same.to_dict()["layers"] == plain.to_dict()["layers"]
    moved = copy.deepcopy(trained)
    with torch.no_grad():
        for layer in plain.layers:
            moved.get_parameter(layer.name).add_(0.05 * torch.randn_like(moved.get_parameter(layer.name)))
    reference = {l.name: trained.get_parameter(l.name).detach() for l in plain.layers}
    in_context = sensitivity(moved, "int8,int4", calibration, reference=reference)
    on_moved = sensitivity(moved, "int8,int4", calibration)
    for a, b, c in zip(plain.layers, in_context.layers, on_moved.layers):
        for name in ("int8", "int4"):  # the tensor is the reference's; the loss change is the moved model's
            assert b.results[name].weight_sqnr_db == a.results[name].weight_sqnr_db != c.results[name].weight_sqnr_db
            assert b.results[name].nbytes == a.results[name].nbytes
    assert [l.results["int4"].loss_delta for l in in_context.layers] != [l.results["int4"].loss_delta for l in plain.layers]
    with pytest.raises(AOQError, match="sensitivity reference 'nope'"):
        sensitivity(trained, "int8", calibration, reference={"nope": torch.zeros(2, 2)})
