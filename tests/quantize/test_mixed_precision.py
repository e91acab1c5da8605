"""Mixed precision under a size budget (hf_aoq.mixed_precision): the knapsack against brute force,
a loss ceiling on a trained tiny model, AOQConfig(target_bits_per_weight=...) through
transformers (saved as an ordinary FqnToConfig that loads with no special code), and
`hf-aoq quantize --bits`."""
import itertools
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_aoq import AOQConfig, AOQError, AOQTensor, FqnToConfig, Int4DQWeightOnlyConfig, Int8WeightOnlyConfig, cli
from hf_aoq import quantize_
from hf_aoq.mixed_precision import choose_recipe, quantize_mixed_precision
from hf_aoq.sensitivity import Candidate, LayerSensitivity, Measurement, SensitivityReport, mean_loss

from models import markov_tokens, trained_tiny_model


def synthetic_report(seed=0, layers=6):
    g = torch.Generator().manual_seed(seed)
    cands = [Candidate("a", Int4DQWeightOnlyConfig()), Candidate("b", Int8WeightOnlyConfig()), Candidate("bf16", None)]
    out = []
    for i in range(layers):
        numel = int(torch.randint(1, 5, (1,), generator=g)) * 1000
        s = float(torch.rand(1, generator=g)) + 0.01
        results = {name: Measurement(bits, int(numel * bits / 8), 0.0, 0.0, s * d, 0.0, 0.0)
                   for name, bits, d in (("a", 4.5, 1.0), ("b", 8.5, 0.01 + 0.1 * float(torch.rand(1, generator=g))),
                                         ("bf16", 16, 0.0))}
        out.append(LayerSensitivity(f"l{i}.weight", "linear", (numel // 100, 100), (), results))
    return SensitivityReport(cands, out, 2.0, 100)


@pytest.mark.parametrize("seed,bits", [(0, 5.0), (1, 6.5), (2, 9.0), (3, 4.6)])
def test_the_choice_is_within_one_upgrade_of_the_best_and_fits(seed, bits):
    report = synthetic_report(seed)
    chosen = choose_recipe(report, bits)
    numel = sum(l.numel for l in report.layers)
    assert chosen.bits_per_weight <= bits
    best = math.inf
    for combo in itertools.product(["a", "b", "bf16"], repeat=len(report.layers)):
        size = sum(l.results[c].nbytes for l, c in zip(report.layers, combo))
        if 8 * size <= bits * numel:
            best = min(best, sum(l.results[c].loss_delta for l, c in zip(report.layers, combo)))
    assert chosen.predicted_loss_delta == pytest.approx(sum(report.layers[i].results[c].loss_delta
                                                            for i, c in enumerate(chosen.choices.values())))
    worst_step = max(l.results["a"].loss_delta for l in report.layers)
    assert best <= chosen.predicted_loss_delta <= best + worst_step
    assert isinstance(chosen.recipe, FqnToConfig) and set(chosen.recipe.mapping) == set(chosen.choices)
    assert {chosen.recipe.mapping[n] for n, c in chosen.choices.items() if c == "bf16"} <= {None}


def test_a_budget_below_the_smallest_candidate_is_refused():
    with pytest.raises(AOQError, match="below the smallest candidates' 4.4"):
        choose_recipe(synthetic_report(), 4.0)
    with pytest.raises(AOQError, match="positive number"):
        choose_recipe(synthetic_report(), 0)
    chosen = choose_recipe(synthetic_report(), 100)
    assert set(chosen.choices.values()) == {"bf16"} and chosen.predicted_loss_delta == 0


def test_mixed_precision_beats_uniform_int4_at_a_budget_between_int4_and_int8():
    model = trained_tiny_model(30)
    calibration = [markov_tokens(8, 65, seed=2)]
    held_out = [markov_tokens(16, 65, seed=3)]
    every_weight = lambda m, n: isinstance(m, (torch.nn.Linear, torch.nn.Embedding))  # noqa: E731
    uniform = trained_tiny_model(30)
    quantize_(uniform, Int4DQWeightOnlyConfig(), every_weight)
    float_loss, int4_loss = mean_loss(model, held_out), mean_loss(uniform, held_out)
    assert int4_loss > float_loss + 0.005
    chosen, report = quantize_mixed_precision(model, 5.5, "int4,int8", calibration, include_embeddings=True)
    assert chosen.bits_per_weight <= 5.5 and set(chosen.counts) == {"int4", "int8"}
    assert [l.name for l in report.layers] == list(chosen.choices)
    assert all(isinstance(model.get_parameter(n), AOQTensor) for n in chosen.choices)
    # The ceiling: closer to float than uniform int4 (measured: +0.012 against +0.018).
    assert mean_loss(model, held_out) - float_loss < 0.8 * (int4_loss - float_loss)
    assert math.isclose(chosen.predicted_perplexity(), math.exp(report.base_loss + chosen.predicted_loss_delta))
    without = trained_tiny_model(30)
    chosen, _ = quantize_mixed_precision(without, 5.5, "int4,int8", calibration)
    assert "embed.weight" not in chosen.choices and not isinstance(without.embed.weight, AOQTensor)


def _text(path, n=300):
    path.write_text(" ".join(f"w{3 + (i * 7) % 500}" for i in range(n)))
    return path


def test_aoq_config_target_bits_saves_an_ordinary_recipe(tiny_llama_dir, tmp_path):
    text = _text(tmp_path / "t.txt")
    config = AOQConfig(target_bits_per_weight=6.0, candidates=["int4", "int8"], calibration=str(text),
                       calibration_tokens=256)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=config, dtype=torch.bfloat16)
    chosen, measured = model.hf_quantizer.mixed_precision
    assert chosen.bits_per_weight <= 6.0 and measured > 0
    used = model.hf_quantizer.quantization_config  # transformers' copy of `config`
    assert isinstance(used.quant_type, FqnToConfig) and len(used.quant_type.mapping) == 14
    model.save_pretrained(tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert saved["quant_type"]["type"] == "FqnToConfig" and saved["target_bits_per_weight"] == 6.0
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    for name, cfg in chosen.recipe.mapping.items():
        p = again.get_parameter(name)
        assert isinstance(p, AOQTensor) and torch.equal(p.dequantize(), model.get_parameter(name).dequantize())
    assert AOQConfig.from_dict(saved).to_dict() == saved


def test_aoq_config_refuses_incomplete_mixed_precision(tmp_path):
    with pytest.raises(AOQError, match="needs calibration text"):
        AOQConfig(target_bits_per_weight=4.5)
    with pytest.raises(AOQError, match="give target_bits_per_weight too"):
        AOQConfig(Int8WeightOnlyConfig(), candidates=["int4"])
    with pytest.raises(AOQError, match="unknown scheme 'int9'"):
        AOQConfig(target_bits_per_weight=4.5, calibration="t.txt", candidates=["int9"])
    with pytest.raises(AOQError, match=r"in \(0, 32\]"):
        AOQConfig(target_bits_per_weight=-1, calibration="t.txt")
    config = AOQConfig(target_bits_per_weight=4.5, calibration="t.txt")
    assert config.candidates == ["int4:g64", "int4", "int8"] and config.quant_type == Int4DQWeightOnlyConfig(64)


def test_quantize_bits_on_the_command_line(tiny_llama_dir, tmp_path, capsys):
    text = _text(tmp_path / "t.txt")
    out = tmp_path / "m"
    rc = cli.main(["quantize", str(tiny_llama_dir), "--bits", "5", "--schemes", "int4,int8", "--calibration", str(text),
                   "--calibration-tokens", "256", "--out", str(out), "--no-measure"])
    printed = capsys.readouterr().out
    assert rc == 0 and "mixed precision:" in printed and "predicted" in printed and "measured" in printed
    saved = json.loads((out / "config.json").read_text())["quantization_config"]
    assert saved["quant_type"]["type"] == "FqnToConfig"
    for args, message in (
        (["--bits", "5"], "--bits needs --calibration"),
        (["--bits", "5", "--scheme", "int4", "--calibration", str(text)], "drop --scheme"),
        (["--schemes", "int4"], "give --bits too"),
    ):
        assert cli.main(["quantize", str(tiny_llama_dir), *args, "--out", str(tmp_path / "x")]) == 2
        assert message in capsys.readouterr().err


def test_smollm2_down_projections_at_six_bits_lose_less_than_uniform_int4():
    """The one real-model test: SmolLM2's 30 down_proj weights (the most sensitive kind in its
    report), int4-plain g256 or int8 at 6 bits per weight on average, against all at g256.
    Calibrated on 512 tokens from 4,096 on; scored on the first 512 (hf_aoq.perplexity's protocol)."""
    import copy

    from hf_aoq import FqnToConfig as Recipe, Int4WeightOnlyConfig, perplexity, smollm2

    model, tokenizer = smollm2.load(torch.bfloat16)
    ids = tokenizer(perplexity.read_text(), return_tensors="pt").input_ids[0]
    scored = perplexity.windows(ids, tokenizer.bos_token_id, n_tokens=512, window=512)
    calibration = perplexity.windows(ids, tokenizer.bos_token_id, n_tokens=512, window=512, offset=4096)
    down = lambda m, n: n.endswith("down_proj")  # noqa: E731
    uniform = copy.deepcopy(model)
    quantize_(uniform, Recipe({"re:.*down_proj": Int4WeightOnlyConfig(256)}))
    base, worst = perplexity.perplexity(model, scored), perplexity.perplexity(uniform, scored)
    del uniform
    chosen, report = quantize_mixed_precision(model, 6.0, "int4-plain:g256,int8", calibration, filter_fn=down)
    assert len(report.layers) == 30 and chosen.bits_per_weight <= 6.0 and set(chosen.counts) == {"int4-plain:g256", "int8"}
    mixed = perplexity.perplexity(model, scored)
    assert mixed - base < 0.6 * (worst - base), (base, mixed, worst)
    assert 0.8 < chosen.predicted_perplexity(base) / mixed < 1.25


def test_sub_four_bit_candidates_fill_a_budget_below_int4():
    """The IntxTensor schemes with a group size ("int3:g64", "int2:g32", as scripts/eval_quality.py
    lists them) are candidates: sized by their own bits, and chosen where a budget under int4 needs them."""
    from hf_aoq.tensors.intx import IntxTensor

    model = trained_tiny_model(30)
    calibration = [markov_tokens(8, 65, seed=2)]
    chosen, report = quantize_mixed_precision(model, 3.5, "int4,int3:g64,int2:g32", calibration)
    bits = {name: {m.bits for l in report.layers if (m := l.results[name]) is not None} for name in
            ("int4", "int3:g64", "int2:g32")}
    # float32 model, so float32 group scales: 3 + 32/64 and 2 + 32/32 (Int4DQ: 4.5 and more on these small shapes)
    assert bits["int3:g64"] == {3.5} and bits["int2:g32"] == {3.0} and min(bits["int4"]) >= 4.5
    assert chosen.bits_per_weight <= 3.5 and set(chosen.counts) & {"int3:g64", "int2:g32"}
    for name, scheme in chosen.choices.items():
        weight = model.get_parameter(name)
        assert isinstance(weight, IntxTensor) == (scheme != "int4")
    assert math.isfinite(mean_loss(model, [markov_tokens(16, 65, seed=3)]))


def test_refine_measures_the_recipe_in_context_and_keeps_the_best_measured():
    """refine_recipe: each round's report is measured on the recipe's model (its calibration
    loss is that model's own), the choice stays within budget, and the recipe returned is the
    one of least measured calibration loss, no worse than the first choice."""
    import copy

    from hf_aoq.mixed_precision import apply_plan, refine_recipe
    from hf_aoq.sensitivity import analysis_plan, parse_candidates, sensitivity

    names = "int4,int3-asym:g64,int3-asym:g128,int2-asym:g32"
    model = trained_tiny_model(30)
    calibration = [markov_tokens(8, 65, seed=2)]
    decisions = analysis_plan(model, parse_candidates(names), include_embeddings=False)
    report = sensitivity(model, names, calibration, decisions=decisions)
    first = choose_recipe(report, 4.1)
    logged = []
    chosen, in_context = refine_recipe(model, first, report, decisions, calibration, rounds=2, log=logged.append)
    assert chosen.bits_per_weight <= 4.1 and in_context.base_loss == report.base_loss
    assert logged and logged[0].startswith("refine round 1: the recipe's calibration loss")

    def measured(plan):
        m = copy.deepcopy(model)
        apply_plan(m, plan, decisions, calibration)
        return mean_loss(m, calibration)

    first_loss = float(logged[0].split("calibration loss ")[1].split()[0])
    assert first_loss == pytest.approx(measured(first), abs=2e-3)  # the in-context report ran the recipe's model
    assert measured(chosen) <= measured(first) + 1e-6
    assert refine_recipe(model, first, report, decisions, calibration, rounds=0)[0] is first
    with pytest.raises(AOQError, match="non-negative integer"):
        refine_recipe(model, first, report, decisions, calibration, rounds=-1)
    with pytest.raises(AOQError, match="non-negative integer"):
        quantize_mixed_precision(trained_tiny_model(30), 4.1, names, calibration, refine=True)


def test_refine_rounds_through_aoq_config_and_the_command_line(tiny_llama_dir, tmp_path, capsys):
    text = _text(tmp_path / "t.txt")
    config = AOQConfig(target_bits_per_weight=6.0, candidates=["int4", "int8"], calibration=str(text),
                       calibration_tokens=256, refine_rounds=1)
    assert config.to_dict()["refine_rounds"] == 1 and AOQConfig.from_dict(config.to_dict()) == config
    assert "refine_rounds" not in AOQConfig(target_bits_per_weight=6.0, calibration=str(text)).to_dict()
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=config, dtype=torch.bfloat16)
    chosen, _ = model.hf_quantizer.mixed_precision
    assert chosen.bits_per_weight <= 6.0 and all(isinstance(model.get_parameter(n), AOQTensor) for n in chosen.choices)
    for bad, message in ((dict(refine_rounds=-1), "non-negative integer"), (dict(refine_rounds=True), "non-negative integer")):
        with pytest.raises(AOQError, match=message):
            AOQConfig(target_bits_per_weight=6.0, calibration=str(text), **bad)
    with pytest.raises(AOQError, match="give target_bits_per_weight too"):
        AOQConfig(Int8WeightOnlyConfig(), refine_rounds=1)
    out = tmp_path / "m"
    rc = cli.main(["quantize", str(tiny_llama_dir), "--bits", "6", "--schemes", "int4,int8", "--refine", "1",
                   "--calibration", str(text), "--calibration-tokens", "256", "--out", str(out), "--no-measure"])
    assert rc == 0 and json.loads((out / "config.json").read_text())["quantization_config"]["refine_rounds"] == 1
    capsys.readouterr()
    assert cli.main(["quantize", str(tiny_llama_dir), "--scheme", "int4", "--refine", "1", "--out", str(tmp_path / "x")]) == 2
    assert "give --bits too" in capsys.readouterr().err
