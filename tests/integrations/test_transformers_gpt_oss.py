"""gpt-oss's experts, stored [E, in, out] (its modules compute x @ w[e]): hf_aoq quantizes their
transpose [E, out, in], groups along "in" as for every linear weight (hf_aoq.quantize
.stored_in_by_out), and holds it as a TransposedExperts view, so that transformers' eager,
batched_mm and grouped_mm forwards run the fast CPU kernels, one linear per expert. The
checkpoint names them in quantization_config.stored_transposed (set by the quantizer), and one
written before (experts quantized as stored, no stored_transposed) still loads, on the reference.
"""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM, MixtralConfig, MixtralForCausalLM

import hf_aoq
from conftest import sqnr
from hf_aoq import (
    AOQConfig,
    AOQTensor,
    Float8WeightOnlyConfig,
    FPXWeightOnlyConfig,
    FqnToConfig,
    Int4DQWeightOnlyConfig,
    Int4Tensor,
    Int4WeightOnlyConfig,
    Int8WeightOnlyConfig,
    kernels,
    quantize,
)
from hf_aoq.configs import MXFPInferenceConfig
from hf_aoq.tensors.experts import TransposedExperts

VOCAB, HIDDEN, INTER, E = 256, 64, 96, 4  # an expert's gate_up is [192, 64], down [64, 96]: no other linear's shapes
EXPERT_SHAPES = {(2 * INTER, HIDDEN), (HIDDEN, INTER)}
SCHEMES = {
    "int4": lambda: Int4WeightOnlyConfig(group_size=32),
    "int8": lambda: Int8WeightOnlyConfig(),
    "int4dq": lambda: Int4DQWeightOnlyConfig(group_size=32),
    "fp8": lambda: Float8WeightOnlyConfig(),
    "mxfp4": lambda: MXFPInferenceConfig(activation_dtype=None, weight_dtype=torch.float4_e2m1fn_x2),
    "fp6": lambda: FPXWeightOnlyConfig(),
}
# Logit SQNR (dB) against the bf16 model, every linear and expert quantized, on this random tiny
# model (measured: int4 18.1, int4dq 20.9, int8 42.1, fp8 22.5, mxfp4 15.6, fp6 23.1; the experts quantized
# as stored, groups along "out", gave 18.9, 20.2, 41.7, 22.4: random weights favour neither axis).
SQNR_VS_BF16 = {"int4": 15, "int8": 38, "int4dq": 17, "fp8": 19, "mxfp4": 12, "fp6": 20}
# Against the same weights dequantized and run in float (the reference path): the kernels round
# activations and partial sums differently (measured 44.5 to 45.3 dB; mxfp4's GEMV computes in
# float32 on the exact weight: equal).
SQNR_VS_REFERENCE = 40
EXPERTS = [f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")]


def gpt_oss_config(intermediate_size=INTER):
    return GptOssConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        vocab_size=VOCAB, intermediate_size=intermediate_size, num_local_experts=E, num_experts_per_tok=2,
                        head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"])


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = GptOssForCausalLM(gpt_oss_config())
    with torch.no_grad():  # gpt-oss initializes its router and expert biases to zero
        for n, p in model.named_parameters():
            if p.abs().max() == 0 and "norm" not in n:
                p.normal_(0, 0.02)
    path = tmp_path_factory.mktemp("gpt_oss")
    model.to(torch.bfloat16).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))


def load(path, **kwargs):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kwargs)


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture
def expert_kernels(monkeypatch):
    """The kernel the table picks for each linear on an expert's matrix, as it runs."""
    picked = []
    select = kernels.select_kernel

    def spy(op, x, w):
        kernel = select(op, x, w)
        if op == "linear" and tuple(w.shape) in EXPERT_SHAPES:
            picked.append(kernel.name)
        return kernel

    monkeypatch.setattr(kernels, "select_kernel", spy)
    return picked


def check_layout(model, config_cls):
    for name in EXPERTS:
        w = model.get_parameter(name)
        assert isinstance(w, TransposedExperts), name
        stored = w.experts
        e, k_in, n_out = w.shape  # the module's [E, in, out]
        assert isinstance(stored, AOQTensor) and stored.shape == (e, n_out, k_in), name  # stored [E, out, in]
        if isinstance(config_cls, (Int4WeightOnlyConfig, Int4DQWeightOnlyConfig)):
            assert stored.block_size == (1, 1, 32), name  # groups along "in", the reduction axis


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
def test_quantize_on_load_runs_the_experts_on_the_fast_kernels(gpt_oss_dir, ids, scheme, implementation,
                                                              expert_kernels):
    if implementation != "grouped_mm" and scheme not in ("int4", "int8"):
        pytest.skip("every implementation for int4 and int8; grouped_mm (the default) for the rest")
    config = SCHEMES[scheme]()
    model = load(gpt_oss_dir, quantization_config=AOQConfig(config), experts_implementation=implementation)
    check_layout(model, config)
    assert model.config.quantization_config.stored_transposed == sorted(EXPERTS)
    out = logits(model, ids)
    if kernels.cpu_ext.available():
        assert expert_kernels and "reference" not in expert_kernels, (scheme, implementation, set(expert_kernels))
    bf16 = logits(load(gpt_oss_dir, experts_implementation=implementation), ids)
    assert sqnr(bf16, out) > SQNR_VS_BF16[scheme], sqnr(bf16, out)
    # The same weights on the reference path: each quantized weight dequantized, run in float.
    model.dequantize()
    assert not any(isinstance(p, (AOQTensor, TransposedExperts)) for p in model.parameters())
    assert sqnr(logits(model, ids), out) > SQNR_VS_REFERENCE


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_quantize_gives_the_tensors_of_quantize_on_load(gpt_oss_dir, ids, scheme, expert_kernels):
    recipe = FqnToConfig({"_default": SCHEMES[scheme](), "lm_head": None})  # transformers' default skips lm_head
    loaded = load(gpt_oss_dir, quantization_config=AOQConfig(recipe))
    model = hf_aoq.quantize_(load(gpt_oss_dir), recipe)
    check_layout(model, SCHEMES[scheme]())
    for name in EXPERTS:
        a, b = model.get_parameter(name).experts, loaded.get_parameter(name).experts
        assert type(a) is type(b) and a.packing == b.packing and a.attributes() == b.attributes(), name
        assert torch.equal(a.dequantize(), b.dequantize()), name
    assert torch.equal(logits(model, ids), logits(loaded, ids))
    if kernels.cpu_ext.available():
        assert expert_kernels and "reference" not in expert_kernels


@pytest.mark.parametrize("scheme", ["int4", "int8", "mxfp4", "fp6"])
def test_save_and_reload_with_no_user_action(gpt_oss_dir, ids, scheme, tmp_path):
    model = load(gpt_oss_dir, quantization_config=AOQConfig(SCHEMES[scheme]()))
    expected = logits(model, ids)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert saved["stored_transposed"] == sorted(EXPERTS)
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    check_layout(again, SCHEMES[scheme]())
    for name in EXPERTS:
        a, b = model.get_parameter(name).experts, again.get_parameter(name).experts
        assert getattr(a, "packing", None) == getattr(b, "packing", None), name
        for field, t in a.to_canonical().tensor_fields().items():  # bit for bit
            assert torch.equal(t.view(torch.uint8), b.to_canonical().tensor_fields()[field].view(torch.uint8)), name
    assert torch.equal(logits(again, ids), expected)


def test_torch_compile_fullgraph_matches_eager(gpt_oss_dir, ids):
    model = load(gpt_oss_dir, quantization_config=AOQConfig(SCHEMES["int4"]()), experts_implementation="grouped_mm")
    check_layout(model, SCHEMES["int4"]())  # the transposed views, traced
    with torch.no_grad():
        eager = model(ids[:1]).logits.float()
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)(ids[:1]).logits.float()
    torch._dynamo.reset()
    # The compiled graph fuses the float ops around the experts differently: bf16 rounding.
    err = float((compiled - eager).abs().max() / eager.abs().max())
    assert err <= 0.02, err


def test_a_checkpoint_of_the_old_layout_still_loads_and_runs(gpt_oss_dir, ids, tmp_path, monkeypatch):
    # Written as hf_aoq did before it knew gpt-oss's layout: experts quantized as stored,
    # [E, in, out] (groups along "out"), and no stored_transposed.
    with monkeypatch.context() as m:
        m.setattr(quantize, "IN_BY_OUT_EXPERTS", {})
        old = load(gpt_oss_dir, quantization_config=AOQConfig(SCHEMES["int4"]()))
        assert type(old.get_parameter(EXPERTS[0])) is Int4Tensor
        expected = logits(old, ids)
        old.save_pretrained(tmp_path)
    assert "stored_transposed" not in json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    for name in EXPERTS:
        w = again.get_parameter(name)
        assert type(w) is Int4Tensor and w.shape == old.get_parameter(name).shape, name  # [E, in, out], as stored
    assert torch.equal(logits(again, ids), expected)


def test_the_layout_is_known_by_the_experts_class_not_by_the_shape():
    torch.manual_seed(0)
    square = GptOssForCausalLM(gpt_oss_config(intermediate_size=HIDDEN))  # down_proj [E, 64, 64], like gpt-oss-20b's
    decisions = quantize.plan(square, Int8WeightOnlyConfig())
    assert all(decisions[n].transposed and decisions[n].place for n in EXPERTS)
    mixtral = MixtralForCausalLM(MixtralConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                               num_local_experts=E, num_experts_per_tok=2))
    decisions = quantize.plan(mixtral, Int8WeightOnlyConfig())  # [E, out, in], square too: as stored
    assert not decisions["model.layers.0.mlp.experts.down_proj"].transposed
    experts = square.model.layers[0].mlp.experts
    sub = type("MyExperts", (type(experts),), {})  # a subclass (e.g. a kernel's replacement) is the same layout
    assert quantize.stored_in_by_out(experts, "down_proj") and quantize.stored_in_by_out(sub.__new__(sub), "down_proj")
    assert not quantize.stored_in_by_out(experts, "gate_up_proj_bias")


def test_a_state_dict_file_refuses_the_view_naming_it(tmp_path):
    model = hf_aoq.quantize_(GptOssForCausalLM(gpt_oss_config()), Int8WeightOnlyConfig())
    with pytest.raises(hf_aoq.FormatError, match=r"tensor 'model.layers.0.mlp.experts.gate_up_proj': is a "
                                                 r"TransposedExperts view"):
        hf_aoq.serialization.save_file(model.state_dict(), str(tmp_path / "m.safetensors"))
    assert not (tmp_path / "m.safetensors").exists()
