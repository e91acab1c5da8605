"""Static float8 activation scales chosen on calibration text (hf_aoq.activation_scales), as a
function, through quantize_with_calibration, through AOQConfig(calibration=...) +
from_pretrained + save/reload, and through `hf-aoq quantize --scheme fp8-static`; and the
activation-quantized int4 configs through from_pretrained (streaming), save and reload."""
import json
import random

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import hf_aoq
from hf_aoq import (
    AOQConfig,
    AOQError,
    Float8StaticActivationFloat8WeightConfig,
    Float8Tensor,
    FqnToConfig,
    Int4Tensor,
    Int8WeightOnlyConfig,
    calibrate_activation_scales,
    cli,
    quantize_,
)
from hf_aoq.calibration import quantize_with_calibration

from conftest import sqnr
from models import tiny_llama


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, ids):
        return self.down(torch.relu(self.up(self.embed(ids))))


def batches(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 32, (2, 7), generator=g) for _ in range(n)]


def test_the_scale_is_the_largest_input_over_the_float8_maximum():
    torch.manual_seed(0)
    model = TwoLinears()
    seen = {"up": 0.0, "down": 0.0}
    hooks = [getattr(model, n).register_forward_pre_hook(
        lambda m, a, n=n: seen.__setitem__(n, max(seen[n], float(a[0].abs().max())))) for n in seen]
    with torch.no_grad():
        for ids in batches():
            model(ids)
    for h in hooks:
        h.remove()
    recipe = calibrate_activation_scales(
        model, FqnToConfig({"up": Float8StaticActivationFloat8WeightConfig(), "down": Int8WeightOnlyConfig()}), batches()
    )
    assert isinstance(recipe, FqnToConfig)
    up = recipe.mapping["up.weight"]
    assert up.scale == pytest.approx(seen["up"] / 448, rel=1e-6)
    assert recipe.mapping["down.weight"] == Int8WeightOnlyConfig()  # other configs as they were
    quantize_(model, recipe)
    assert isinstance(model.up.weight, Float8Tensor) and model.up.weight.act_quant == "static"
    assert float(model.up.weight.act_scale) == pytest.approx(up.scale)
    # e5m2 activations: their own maximum.
    e5m2 = calibrate_activation_scales(TwoLinears(), Float8StaticActivationFloat8WeightConfig(
        activation_dtype=torch.float8_e5m2), batches())
    assert all(c.scale is not None for c in e5m2.mapping.values())


def test_a_given_scale_is_kept_and_non_linears_are_refused():
    model = TwoLinears()
    recipe = calibrate_activation_scales(model, Float8StaticActivationFloat8WeightConfig(scale=0.125), batches())
    assert {c.scale for c in recipe.mapping.values()} == {0.125}
    with pytest.raises(AOQError, match="nn.Linear weights only"):
        calibrate_activation_scales(model, FqnToConfig({"embed": Float8StaticActivationFloat8WeightConfig()}), batches())
    with pytest.raises(AOQError, match="at least one batch"):
        calibrate_activation_scales(model, Float8StaticActivationFloat8WeightConfig(), [])


def test_quantize_with_calibration_chooses_static_scales_on_the_float_model():
    model = tiny_llama(seed=0)
    reference = tiny_llama(seed=0)
    ids = [torch.randint(3, 512, (1, 24), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    recipe = FqnToConfig({"_default": Float8StaticActivationFloat8WeightConfig(), "lm_head": None})
    quantize_with_calibration(model, recipe, ids)
    w = model.model.layers[1].mlp.down_proj.weight
    assert isinstance(w, Float8Tensor) and w.act_quant == "static" and float(w.act_scale) > 0
    expected = calibrate_activation_scales(reference, recipe, ids).mapping["model.layers.1.mlp.down_proj.weight"].scale
    assert float(w.act_scale) == pytest.approx(expected, rel=1e-6)
    with torch.no_grad():
        assert sqnr(reference(ids[0]).logits, model(ids[0]).logits) > 15


def calibration_text(path):
    rng = random.Random(0)
    path.write_text(" ".join(f"w{rng.randrange(3, 512)}" for _ in range(300)))
    return path


def test_from_pretrained_calibrates_and_the_checkpoint_records_the_scales(tiny_llama_dir, tmp_path):
    text = calibration_text(tmp_path / "calibration.txt")
    config = AOQConfig(Float8StaticActivationFloat8WeightConfig(), calibration=str(text), calibration_tokens=128)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16, quantization_config=config)
    w = model.model.layers[0].self_attn.q_proj.weight
    assert isinstance(w, Float8Tensor) and w.act_quant == "static"
    model.save_pretrained(tmp_path / "out")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    w2 = again.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(w2.act_scale, w.act_scale) and torch.equal(w2.qdata, w.qdata)
    ids = torch.randint(3, 512, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
    # Without calibration there is nothing to choose the scales from.
    with pytest.raises(AOQError, match="scale is None and there is no calibration"):
        AOQConfig(Float8StaticActivationFloat8WeightConfig())


def test_cli_fp8_static_needs_calibration(tiny_llama_dir, tmp_path, capsys):
    text = calibration_text(tmp_path / "calibration.txt")
    out = tmp_path / "fp8s"
    assert cli.main(["quantize", str(tiny_llama_dir), "--scheme", "fp8-static", "--calibration", str(text),
                     "--calibration-tokens", "128", "--out", str(out), "--no-measure"]) == 0
    stored = json.loads((out / "config.json").read_text())["quantization_config"]
    assert stored["calibration"] == str(text)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.model.layers[1].mlp.up_proj.weight.act_quant == "static"
    assert "static-act e4m3" in (out / "README.md").read_text()  # the model card names it
    assert cli.main(["quantize", str(tiny_llama_dir), "--scheme", "fp8-static", "--out", str(tmp_path / "x")]) != 0
    assert "needs --calibration" in capsys.readouterr().err


@pytest.mark.parametrize("scheme, act", [("int8-int4", torch.int8), ("int4-int4", torch.int4),
                                         ("fp8-int4", torch.float8_e4m3fn)])
def test_act_int4_schemes_through_from_pretrained_and_reload(scheme, act, tiny_llama_dir, tmp_path):
    config = AOQConfig(hf_aoq.configs.config_for_scheme(scheme))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16, quantization_config=config)
    w = model.model.layers[0].mlp.gate_proj.weight
    assert isinstance(w, Int4Tensor) and w.act_quant == "per_token" and w.act_dtype == act
    model.save_pretrained(tmp_path / "out")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = torch.randint(3, 512, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
    assert torch.equal(again.model.layers[0].mlp.gate_proj.weight.dequantize(), w.dequantize())
