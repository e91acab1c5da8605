"""Activation-aware scales (hf_aoq.awq) folded into llama-style blocks: the folds leave the float
model's function unchanged, blocks where they would not are refused before anything changes,
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


def test_a_block_the_folds_would_change_is_refused_before_anything_changes():
    model = loud_llama()
    layer = model.model.layers[1]
    layer.post_attention_layernorm = OnePlusNorm(layer.post_attention_layernorm.weight)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(AOQError, match=r"model.layers.1: folding scales from post_attention_layernorm into "
                                       r"mlp.gate_proj, mlp.up_proj changes the block's output"):
        quantize_with_awq(model, Int4WeightOnlyConfig(32), batches(2), filter_fn=not_lm_head)
    for n, p in model.named_parameters():
        assert type(p.data) is torch.Tensor and torch.equal(p.data, before[n]), n


def test_a_model_without_llama_blocks_is_refused():
    model = tiny_model()
    with pytest.raises(AOQError, match=r"layers.0: not a llama-style decoder block \(no input_layernorm"):
        quantize_with_awq(model, Int4WeightOnlyConfig(32), [torch.randint(0, 128, (1, 16))])
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
