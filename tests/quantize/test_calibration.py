"""Calibrated int4 (GPTQ, hf_aoq.calibration) and the data-free parameter search, on small
random weights and a tiny Llama. SmolLM2's perplexities are in test_transformers_smollm2.py."""
import json
import random

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from hf_aoq import (AOQConfig, AOQError, AOQTensor, FqnToConfig, Int4DQTensor, Int4Tensor, Int4WeightOnlyConfig, Int8Tensor,
                    Int8WeightOnlyConfig)
from hf_aoq import cli
from hf_aoq.calibration import gptq_int4, quantize_with_calibration

from conftest import sqnr


def correlated_inputs(k: int, rows: int, seed: int = 0) -> torch.Tensor:
    """Inputs with a few loud channels and correlations, as real activations have."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k)
    x = torch.randn(rows, k, generator=g) @ mix
    x[:, : k // 16] *= 8
    return x


@pytest.mark.parametrize("k,g,symmetric,qparams", [(256, 64, False, "minmax"), (96, 64, False, "mse"), (128, 32, True, "mse")])
def test_gptq_lowers_the_output_error_of_round_to_nearest(k, g, symmetric, qparams):
    torch.manual_seed(0)
    w = torch.randn(48, k, dtype=torch.bfloat16)
    x = correlated_inputs(k, 2048)
    cfg = Int4WeightOnlyConfig(g, symmetric, qparams)
    q = gptq_int4(w, x.t() @ x, cfg)
    rtn = cfg.quantize_weight(w)
    assert isinstance(q, Int4Tensor) and q.shape == w.shape and q.dtype == w.dtype
    assert q.scale.shape == rtn.scale.shape and (q.zero is None) == symmetric
    # Exactly an Int4Tensor: its fields check out as if loaded from a file, and it packs.
    Int4Tensor.check_fields({**q.tensor_fields(), **q.attributes()})
    assert torch.equal(q.place().dequantize(), q.dequantize())
    exact = x @ w.float().t()
    assert sqnr(exact, x @ q.dequantize().float().t()) > sqnr(exact, x @ rtn.dequantize().float().t()) + 1.0


def test_gptq_ignores_dead_inputs_and_names_bad_shapes():
    w = torch.randn(16, 64)
    x = torch.randn(256, 64)
    x[:, 5] = 0  # an input channel that never fires
    q = gptq_int4(w, x.t() @ x, Int4WeightOnlyConfig(32))
    assert torch.isfinite(q.dequantize()).all()
    with pytest.raises(AOQError, match="layer.weight: Gram matrix of shape \\(32, 32\\) does not match weight 16x64"):
        gptq_int4(w, torch.eye(32), Int4WeightOnlyConfig(32), name="layer.weight")


def test_mse_search_is_never_worse_than_min_max():
    torch.manual_seed(0)
    w = torch.randn(64, 576) * torch.rand(64, 1)  # rows of different scales, a partial last group
    w[3, 7] = 9.0  # an outlier, which the search may clip
    for symmetric in (False, True):
        minmax = Int4Tensor.from_float(w, 128, symmetric, qparams="minmax").dequantize()
        mse = Int4Tensor.from_float(w, 128, symmetric, qparams="mse").dequantize()
        err_minmax = (minmax - w).square().reshape(64, -1)
        err_mse = (mse - w).square().reshape(64, -1)
        for start in range(0, 576, 128):  # group by group
            assert (err_mse[:, start:start + 128].sum(1) <= err_minmax[:, start:start + 128].sum(1) * (1 + 1e-3)).all()
        assert err_mse.sum() < err_minmax.sum()
    with pytest.raises(AOQError, match="qparams must be one of"):
        Int4WeightOnlyConfig(qparams="best")


def token_batches(n: int = 4, length: int = 33, vocab: int = 512, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (1, length), generator=g) for _ in range(n)]


def test_quantize_with_calibration_on_a_tiny_llama(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    recipe = FqnToConfig({"_default": Int4WeightOnlyConfig(32), "re:.*down_proj": Int8WeightOnlyConfig()})
    logs = []
    report = quantize_with_calibration(model, recipe, token_batches(), filter_fn=lambda m, f: "lm_head" not in f,
                                       log=logs.append)
    layers = model.model.layers
    assert isinstance(layers[0].self_attn.q_proj.weight, Int4Tensor)
    assert isinstance(layers[1].mlp.down_proj.weight, Int8Tensor)  # other configs: as quantize_ does
    assert not isinstance(model.lm_head.weight, AOQTensor)
    assert len(report.calibrated) == 2 * 6 and report.layers == 2 and report.tokens == 4 * 33
    assert len(logs) == 2 and "model.layers.1" in logs[1]
    ids = token_batches(1, seed=1)[0]
    with torch.no_grad():
        assert sqnr(reference(ids).logits, model(ids).logits) > 15


def test_calibration_through_from_pretrained_save_and_reload(tiny_llama_dir, tmp_path):
    text = tmp_path / "calibration.txt"
    rng = random.Random(0)
    text.write_text(" ".join(f"w{rng.randrange(3, 512)}" for _ in range(300)))
    config = AOQConfig(Int4WeightOnlyConfig(32), calibration=str(text), calibration_tokens=256)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16, quantization_config=config)
    assert isinstance(model.model.layers[0].mlp.up_proj.weight, Int4Tensor)
    plain = AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, dtype=torch.bfloat16, quantization_config=AOQConfig(Int4WeightOnlyConfig(32))
    )
    w_cal = model.model.layers[1].mlp.up_proj.weight.dequantize()
    assert not torch.equal(w_cal, plain.model.layers[1].mlp.up_proj.weight.dequantize())  # the data mattered
    model.save_pretrained(tmp_path / "out")
    stored = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert stored["calibration"] == str(text) and stored["calibration_tokens"] == 256
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = token_batches(1, seed=2)[0]
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
    assert AOQConfig.from_dict(stored) == config
    # Without calibration, config.json has no calibration keys (older readers keep reading it).
    assert "calibration" not in AOQConfig(Int4WeightOnlyConfig(32)).to_dict()
    with pytest.raises(AOQError, match="calibration_tokens must be an int >= 2"):
        AOQConfig(Int4WeightOnlyConfig(32), calibration=str(text), calibration_tokens=0)
    with pytest.raises(AOQError, match="no such text file"):
        AutoModelForCausalLM.from_pretrained(
            tiny_llama_dir, quantization_config=AOQConfig(Int4WeightOnlyConfig(32), calibration=str(tmp_path / "none.txt"))
        )


def test_cli_quantize_with_calibration(tiny_llama_dir, tmp_path, capsys):
    text = tmp_path / "calibration.txt"
    text.write_text(" ".join(f"w{i % 500 + 3}" for i in range(200)))
    out = tmp_path / "int4"
    rc = cli.main(["quantize", str(tiny_llama_dir), "--scheme", "int4-plain", "--group-size", "32",
                   "--calibration", str(text), "--calibration-tokens", "128", "--out", str(out), "--no-measure"])
    assert rc == 0
    again = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(again.model.layers[0].self_attn.o_proj.weight, Int4Tensor)
    # The default int4 (Int4DQ) takes GPTQ too: other codes than plain rounding's, the same type.
    for name, extra in (("dq-gptq", ["--calibration", str(text), "--calibration-tokens", "128"]), ("dq", [])):
        assert cli.main(["quantize", str(tiny_llama_dir), "--scheme", "int4", *extra, "--out", str(tmp_path / name),
                         "--no-measure"]) == 0
    calibrated, rounded = (AutoModelForCausalLM.from_pretrained(tmp_path / n).model.layers[0].mlp.down_proj.weight
                           for n in ("dq-gptq", "dq"))
    assert isinstance(calibrated, Int4DQTensor) and isinstance(rounded, Int4DQTensor)
    assert not torch.equal(calibrated.qdata, rounded.qdata)
    rc = cli.main(["quantize", str(tiny_llama_dir), "--scheme", "int4", "--calibration", str(tmp_path / "missing.txt"),
                   "--out", str(tmp_path / "x")])
    assert rc != 0
    assert "--calibration" in capsys.readouterr().err


class Experts(nn.Module):
    """A block whose experts (a numbered ModuleList inside a numbered ModuleList) see different
    tokens: expert e takes the rows with index % 2 == e."""

    def __init__(self, width):
        super().__init__()
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(width, width, bias=False)) for _ in range(2))
        # Expert 1's inputs have a few loud channels, so its Gram matrix is far from expert 0's.
        gain = torch.ones(2, width)
        gain[1, :8] = 30.0
        self.register_buffer("gain", gain)

    def forward(self, x):
        out = torch.empty_like(x)
        for e, expert in enumerate(self.experts):
            out[:, e::2] = expert(x[:, e::2] * self.gain[e])
        return x + out


class ToyModel(nn.Module):
    def __init__(self, width=64, vocab=50):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Experts(width) for _ in range(2))

    def forward(self, ids, use_cache=None):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return x


def test_nested_numbered_modules_are_calibrated_on_their_own_inputs():
    torch.manual_seed(0)
    model = ToyModel()
    batches = [torch.randint(0, 50, (1, 40), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    expert = model.layers[0].experts[1][0]  # named layers.0.experts.1.0
    seen = []
    handle = expert.register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, 64).float()))
    with torch.no_grad():
        for ids in batches:
            model(ids)
    handle.remove()
    x = torch.cat(seen)
    expert_weight = expert.weight.detach().clone()
    cfg = Int4WeightOnlyConfig(32)
    expected = gptq_int4(expert.weight.data, x.t() @ x, cfg)
    report = quantize_with_calibration(model, cfg, batches)
    assert report.layers == 2 and len(report.calibrated) == 4
    # The same GPTQ problem, up to the order the Gram matrix is summed in: the same error on
    # this expert's own inputs (an expert calibrated on another's inputs does worse).
    exact = x @ expert_weight.t()
    got = sqnr(exact, x @ expert.weight.dequantize().t())
    assert got > sqnr(exact, x @ expected.dequantize().t()) - 0.05


class TiedPair(nn.Module):
    """Two linears that share one weight (one tensor under two names)."""

    def __init__(self, width=64, vocab=50):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.first = nn.Linear(width, width, bias=False)
        self.second = nn.Linear(width, width, bias=False)
        self.second.weight = self.first.weight

    def forward(self, ids):
        return self.second(torch.relu(self.first(self.embed(ids))))


def test_calibration_plans_with_quantize_plan_and_keeps_ties(monkeypatch):
    # calibration.py decided which weights to calibrate by resolving configs itself; it now
    # takes quantize.plan's decisions, so a tensor under two names is calibrated once and
    # stays one tensor (it was calibrated twice, once per name, and came apart).
    import hf_aoq.calibration as calibration

    calls = []
    real = calibration.plan
    monkeypatch.setattr(calibration, "plan", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    torch.manual_seed(0)
    model = TiedPair()
    batches = [torch.randint(0, 50, (1, 40), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    cfg = Int4WeightOnlyConfig(32)
    report = quantize_with_calibration(model, cfg, batches)
    assert calls == [cfg]
    assert report.calibrated == ["first"]
    assert isinstance(model.first.weight, Int4Tensor) and model.second.weight is model.first.weight
