"""SmoothQuant-style scales (hf_aoq.smoothquant) for int8 weights with dynamic int8 activations:
on a tiny Llama whose activations have a few loud channels, the migrated model loses less than
the same config without calibration, and the scales are chosen only for int8-dynamic weights."""
import copy

import torch

from hf_aoq import FqnToConfig, Int8DynamicActivationInt8WeightConfig, Int8Tensor, Int8WeightOnlyConfig, quantize_
from hf_aoq.calibration import quantize_with_calibration
from hf_aoq.channel_scales import ScalePair
from hf_aoq.smoothquant import SmoothQuant, quantize_with_smoothquant

from test_awq import batches, loud_llama, mean_loss, not_lm_head

INT8_DYN = Int8DynamicActivationInt8WeightConfig()


def test_smoothquant_loses_less_than_no_calibration():
    reference = loud_llama()
    plain, calibrated = copy.deepcopy(reference), copy.deepcopy(reference)
    quantize_(plain, INT8_DYN, not_lm_head)
    report = quantize_with_calibration(calibrated, INT8_DYN, batches(), filter_fn=not_lm_head, method="smoothquant")
    assert report.method == "smoothquant" and report.pairs == 8 and len(report.calibrated) == 14
    w = calibrated.model.layers[0].self_attn.q_proj.weight
    assert isinstance(w, Int8Tensor) and w.act_quant == "per_token"
    assert any(c["alpha"] is not None for c in report.choices)
    scored = batches(seed=7)
    kl_plain, kl_sq = mean_loss(plain, scored, reference), mean_loss(calibrated, scored, reference)
    assert kl_sq < 0.7 * kl_plain, (kl_sq, kl_plain)
    assert kl_sq < 0.01  # the ceiling on the slice


def test_the_search_keeps_no_migration_when_nothing_is_loud():
    torch.manual_seed(0)
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    x = torch.randn(256, 64)
    method = SmoothQuant()
    s, info = method.choose(ScalePair("norm", ("lin",)), {"lin": w}, {"lin": INT8_DYN}, method.collect(x, None))
    assert info["error_ratio"] <= 1.0 and torch.isfinite(s).all() and (s > 0).all()
    x[:, 3] *= 50  # one loud channel: migration pays
    s, info = method.choose(ScalePair("norm", ("lin",)), {"lin": w}, {"lin": INT8_DYN}, method.collect(x, None))
    assert info["alpha"] is not None and info["error_ratio"] < 0.5 and s[3] == s.max()


def test_weight_only_int8_is_left_to_the_plan():
    model = loud_llama()
    recipe = FqnToConfig({"_default": INT8_DYN, "re:.*mlp\\..*": Int8WeightOnlyConfig()})
    report = quantize_with_smoothquant(model, recipe, batches(2), filter_fn=not_lm_head)
    assert report.pairs == 4  # norm -> q/k/v and v -> o, in each of 2 blocks
    assert model.model.layers[0].mlp.up_proj.weight.act_quant is None
