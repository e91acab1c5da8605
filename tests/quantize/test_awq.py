"""Activation-aware scales (hf_aoq.awq) folded into llama-style blocks: the folds leave the float
model's function unchanged, linears whose scales cannot fold keep them as input_scale (SmoothQuant
refuses such blocks before anything changes),
and on a tiny Llama with loud activation channels the calibrated int4 / Int4DQ weights lose less
than the same configs without calibration."""
import copy
import math

import pytest
import torch
from torch import nn

from hf_aoq import AOQConfig, AOQError, Int4DQTensor, Int4DQWeightOnlyConfig, Int4Tensor, Int4WeightOnlyConfig
from hf_aoq import FqnToConfig, Int8WeightOnlyConfig, quantize_
from hf_aoq.awq import AWQ, output_error, quantize_with_awq
from hf_aoq.calibration import quantize_with_calibration
from hf_aoq.channel_scales import check_folds, fold, llama_pairs

from models import tiny_llama, tiny_model


def loud_llama(seed=0):
    """A tiny bf16 Llama (4 query heads on 2 KV heads) whose norms make a few channels loud, as
    real models' activations have: the case activation-aware scales are for."""
    model = tiny_llama(seed=seed, hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                loud = torch.randperm(128, generator=g)[:6]
                norm.weight[loud] *= 12
    return model


def batches(n=4, length=64, vocab=512, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (1, length), generator=g) for _ in range(n)]


def mean_loss(model, ids_list, reference):
    """Mean KL (nats per token) of the model's next-token distribution to the float model's."""
    total = count = 0
    with torch.no_grad():
        for ids in ids_list:
            p = reference(ids).logits.float().log_softmax(-1)
            q = model(ids).logits.float().log_softmax(-1)
            total += torch.nn.functional.kl_div(q, p, log_target=True, reduction="sum").item()
            count += ids.numel()
    return total / count


def not_lm_head(module, fqn):
    return isinstance(module, nn.Linear) and "lm_head" not in fqn


@pytest.mark.parametrize("config,tensor_type", [(Int4WeightOnlyConfig(32), Int4Tensor),
                                                (Int4DQWeightOnlyConfig(32), Int4DQTensor)])
def test_awq_loses_less_than_no_calibration(config, tensor_type):
    reference = loud_llama()
    plain, calibrated = copy.deepcopy(reference), copy.deepcopy(reference)
    quantize_(plain, config, not_lm_head)
    report = quantize_with_calibration(calibrated, config, batches(), filter_fn=not_lm_head, method="awq")
    assert report.method == "awq" and report.layers == 2 and report.pairs == 8 and len(report.calibrated) == 14
    assert isinstance(calibrated.model.layers[1].mlp.down_proj.weight, tensor_type)
    assert any(c["alpha"] > 0 for c in report.choices)
    scored = batches(seed=7)  # not the calibration tokens
    kl_plain, kl_awq = mean_loss(plain, scored, reference), mean_loss(calibrated, scored, reference)
    # Measured (int4 g32 / Int4DQ g32): about 0.6x the KL of no calibration.
    assert kl_awq < 0.85 * kl_plain, (kl_awq, kl_plain)
    assert kl_awq < 0.05  # the ceiling on the slice


def test_the_folds_leave_the_float_model_unchanged():
    model = loud_llama().float()
    block = model.model.layers[0]
    pairs = llama_pairs(block, "model.layers.0")
    assert [(p.producer, p.consumers, p.repeat) for p in pairs] == [
        ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), 1),
        ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), 1),
        ("self_attn.v_proj", ("self_attn.o_proj",), 2),  # 4 query heads share 2 KV heads
        ("mlp.up_proj", ("mlp.down_proj",), 1),
    ]
    ids = batches(1)[0]
    with torch.no_grad():
        before = model(ids).logits
        g = torch.Generator().manual_seed(0)
        for p in pairs:
            c = block.get_submodule(p.producer).weight.shape[0]
            fold(block, p, torch.exp(torch.randn(c, generator=g)))
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


class OnePlusNorm(nn.Module):
    """A Gemma-style RMSNorm, x / rms(x) * (1 + weight): dividing its weight does not divide its output."""

    def __init__(self, weight):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone() - 1)

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.weight.float())).to(x.dtype)


def test_a_pair_that_cannot_fold_keeps_its_scales_as_input_scale():
    """AWQ: the consumers of a pair the check rejects get their scales as input_scale (and lose
    less than without calibration); the other pairs still fold."""
    reference = loud_llama()
    layer = reference.model.layers[1]
    layer.post_attention_layernorm = OnePlusNorm(layer.post_attention_layernorm.weight)
    plain, model = copy.deepcopy(reference), copy.deepcopy(reference)
    quantize_(plain, Int4WeightOnlyConfig(32), not_lm_head)
    report = quantize_with_awq(model, Int4WeightOnlyConfig(32), batches(), filter_fn=not_lm_head)
    assert report.stored == ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]
    assert report.pairs == 7 and len(report.calibrated) == 14
    for name in ("gate_proj", "up_proj"):
        w = model.model.layers[1].mlp.get_submodule(name).weight
        assert isinstance(w, Int4Tensor) and w.input_scale is not None and w.input_scale.shape == (128,)
    assert model.model.layers[1].mlp.down_proj.weight.input_scale is None  # up_proj -> down_proj folds
    assert model.model.layers[0].mlp.gate_proj.weight.input_scale is None
    scored = batches(seed=7)
    assert mean_loss(model, scored, reference) < mean_loss(plain, scored, reference)


def test_smoothquant_still_refuses_a_block_the_folds_would_change_before_anything_changes():
    from hf_aoq import Int8DynamicActivationInt8WeightConfig
    from hf_aoq.smoothquant import quantize_with_smoothquant

    model = loud_llama()
    layer = model.model.layers[1]
    layer.post_attention_layernorm = OnePlusNorm(layer.post_attention_layernorm.weight)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(AOQError, match=r"model.layers.1: folding scales from post_attention_layernorm into "
                                       r"mlp.gate_proj, mlp.up_proj changes the block's output"):
        quantize_with_smoothquant(model, Int8DynamicActivationInt8WeightConfig(), batches(2), filter_fn=not_lm_head)
    for n, p in model.named_parameters():
        assert type(p.data) is torch.Tensor and torch.equal(p.data, before[n]), n


def loud_tiny_model():
    """tests/models.py's TinyModel (blocks that are not llama-style: nothing folds) in float32,
    with a few loud embedding channels, which q_proj reads straight from the residual."""
    model = tiny_model(torch.float32)
    with torch.no_grad():
        model.embed.weight[:, :4] *= 25
        for layer in model.layers:
            layer.norm.weight[4:8] *= 10
    return model


def tiny_batches(n=4, length=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (1, length), generator=g) for _ in range(n)]


def tiny_kl(model, ids_list, reference):
    total = count = 0
    with torch.no_grad():
        for ids in ids_list:
            p, q = reference(ids).float().log_softmax(-1), model(ids).float().log_softmax(-1)
            total += torch.nn.functional.kl_div(q, p, log_target=True, reduction="sum").item()
            count += ids.numel()
    return total / count


@pytest.mark.parametrize("config,tensor_type", [(Int4WeightOnlyConfig(32), Int4Tensor),
                                                (Int4DQWeightOnlyConfig(32), Int4DQTensor)])
def test_a_model_without_llama_blocks_stores_every_scale_and_loses_less(config, tensor_type):
    reference = loud_tiny_model()
    plain, model = copy.deepcopy(reference), copy.deepcopy(reference)
    blocks_only = lambda m, n: isinstance(m, nn.Linear) and n != "head"  # noqa: E731
    quantize_(plain, config, blocks_only)
    calibration = tiny_batches()
    report = quantize_with_awq(model, config, calibration, filter_fn=blocks_only)
    names = [f"layers.{i}.{n}" for i in range(2) for n in ("q_proj", "up", "down")]
    assert sorted(report.stored) == sorted(names) and report.pairs == 0
    for name in names:
        w = model.get_parameter(name + ".weight")
        assert isinstance(w, tensor_type) and w.input_scale is not None
    assert any(c["alpha"] > 0 for c in report.choices)
    # Its loss on the calibration data (KL to the float model) is below that without AWQ.
    kl_plain, kl_awq = tiny_kl(plain, calibration, reference), tiny_kl(model, calibration, reference)
    assert kl_awq < 0.9 * kl_plain, (kl_awq, kl_plain)


def test_smoothquant_refuses_a_model_without_llama_blocks():
    from hf_aoq import Int8DynamicActivationInt8WeightConfig

    model = tiny_model()
    with pytest.raises(AOQError, match=r"layers.0: not a llama-style decoder block \(no input_layernorm"):
        quantize_with_calibration(model, Int8DynamicActivationInt8WeightConfig(), [torch.randint(0, 128, (1, 16))],
                                  method="smoothquant")
    with pytest.raises(AOQError, match="calibration method must be one of"):
        quantize_with_calibration(model, Int4WeightOnlyConfig(32), [torch.randint(0, 128, (1, 16))], method="hqq")


def test_only_int4_weights_get_scales_and_the_rest_follows_the_plan():
    model = loud_llama()
    recipe = FqnToConfig({"_default": Int4WeightOnlyConfig(32), "re:.*down_proj": Int8WeightOnlyConfig()})
    report = quantize_with_awq(model, recipe, batches(2), filter_fn=not_lm_head)
    assert report.pairs == 6  # up_proj -> down_proj has no int4 consumer
    assert all(c["pair"] != "mlp.up_proj" for c in report.choices)
    assert type(model.model.layers[0].mlp.down_proj.weight).__name__ == "Int8Tensor"
    assert isinstance(model.lm_head.weight.data, torch.Tensor) and type(model.lm_head.weight.data) is torch.Tensor


def test_the_alpha_search_never_does_worse_than_no_scales_on_its_own_measure():
    torch.manual_seed(0)
    x = torch.randn(512, 64)
    x[:, :4] *= 20
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    gram = x.t() @ x
    cfg = Int4WeightOnlyConfig(32)
    from hf_aoq.channel_scales import ScalePair
    s, info = AWQ().choose(ScalePair("norm", ("lin",)), {"lin": w}, {"lin": cfg}, gram)
    assert info["alpha"] > 0 and info["error_ratio"] < 0.9
    assert output_error(w, s, cfg, gram) < output_error(w, torch.ones(64), cfg, gram)


def test_aoq_config_takes_the_calibration_method():
    cfg = AOQConfig(Int4DQWeightOnlyConfig(32), calibration="text.txt", calibration_method="awq")
    d = cfg.to_dict()
    assert d["calibration_method"] == "awq"
    assert AOQConfig.from_dict(d).calibration_method == "awq"
    assert AOQConfig.from_dict({k: v for k, v in d.items() if k != "calibration_method"}).calibration_method == "gptq"
    with pytest.raises(AOQError, match="calibration_method must be one of"):
        AOQConfig(Int4DQWeightOnlyConfig(32), calibration="text.txt", calibration_method="hqq")


def test_awq_through_from_pretrained_and_the_cli(tiny_llama_dir, tmp_path):
    import json

    from transformers import AutoModelForCausalLM

    from hf_aoq import cli

    text = tmp_path / "calibration.txt"
    text.write_text(" ".join(f"w{(i * 7) % 500 + 3}" for i in range(300)))
    config = AOQConfig(Int4DQWeightOnlyConfig(32), calibration=str(text), calibration_tokens=256, calibration_method="awq")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16, quantization_config=config)
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16,
                                                 quantization_config=AOQConfig(Int4DQWeightOnlyConfig(32)))
    assert isinstance(model.model.layers[0].mlp.up_proj.weight, Int4DQTensor)
    # The scales were folded into the norms (the data mattered), which are saved as float.
    assert not torch.equal(model.model.layers[0].input_layernorm.weight, plain.model.layers[0].input_layernorm.weight)
    model.save_pretrained(tmp_path / "out")
    stored = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert stored["calibration_method"] == "awq"
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = batches(1, seed=2)[0]
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
    out = tmp_path / "cli"
    assert cli.main(["quantize", str(tiny_llama_dir), "--scheme", "int4", "--calibration", str(text),
                     "--calibration-tokens", "128", "--calibration-method", "awq", "--out", str(out),
                     "--no-measure"]) == 0
    cli_model = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(cli_model.model.layers[1].self_attn.o_proj.weight, Int4DQTensor)
