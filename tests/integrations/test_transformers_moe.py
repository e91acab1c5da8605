"""MoE models from transformers' own classes through the "aoq" quantizer.

transformers 5 keeps the routed experts of Mixtral and Qwen2-MoE as fused 3-D parameters
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) on a custom module, not as
nn.Linear layers, and converts per-expert checkpoint tensors into them while loading. hf_aoq's
tensor types hold 2-D weights, so the experts stay in float: recipes never select them (they
are not nn.Linear weights) and naming one explicitly is an error. Attention projections, and
Qwen2-MoE's shared expert and its gate (plain nn.Linear), are quantized as usual; the routers
(2-D, but not nn.Linear) are quantized only when named.
"""
import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

from hf_aoq import AOQConfig, AOQError, AOQTensor, FqnToConfig, Int4WeightOnlyConfig, Int8Tensor, Int8WeightOnlyConfig

VOCAB = 256
COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB)
MODELS = {
    "mixtral": (
        MixtralForCausalLM,
        MixtralConfig(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, **COMMON),
    ),
    "qwen2_moe": (
        Qwen2MoeForCausalLM,
        Qwen2MoeConfig(
            intermediate_size=128,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=128,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **COMMON,
        ),
    ),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def moe(request, tmp_path_factory):
    cls, config = MODELS[request.param]
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(request.param)
    cls(config).save_pretrained(path)  # per-expert tensors on disk, as on the Hub
    return request.param, str(path)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_linear_layers_are_quantized_and_experts_stay_float(moe, ids):
    name, path = moe
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=AOQConfig(Int8WeightOnlyConfig()))
    kinds = {n: type(p) for n, p in model.named_parameters()}
    for layer in range(2):
        prefix = f"model.layers.{layer}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert kinds[f"{prefix}.self_attn.{proj}.weight"] is Int8Tensor
        # Fused experts: 3-D, left in float; the router: not nn.Linear, left in float.
        for p in ("gate_up_proj", "down_proj"):
            assert kinds[f"{prefix}.mlp.experts.{p}"] is nn.Parameter
            assert model.get_parameter(f"{prefix}.mlp.experts.{p}").ndim == 3
        assert kinds[f"{prefix}.mlp.gate.weight"] is nn.Parameter
        if name == "qwen2_moe":  # the shared expert and its gate are plain nn.Linear
            shared = ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj", "shared_expert_gate")
            for p in shared:
                assert kinds[f"{prefix}.mlp.{p}.weight"] is Int8Tensor
    ref = logits(AutoModelForCausalLM.from_pretrained(path), ids)
    out = logits(model, ids)
    assert (out - ref).abs().max() < 0.02 * ref.abs().max()


def test_round_trip_through_shards_keeps_logits(moe, ids, tmp_path):
    _, path = moe
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=AOQConfig(Int8WeightOnlyConfig()))
    expected = logits(model, ids)
    model.save_pretrained(tmp_path, max_shard_size="40KB")  # experts split back per expert on save
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert {n for n, p in again.named_parameters() if isinstance(p, AOQTensor)} == {
        n for n, p in model.named_parameters() if isinstance(p, AOQTensor)
    }
    assert torch.equal(logits(again, ids), expected)
    # The fused experts were merged again from per-expert tensors, in float, unchanged.
    for n, p in model.named_parameters():
        if ".experts." in n:
            assert torch.equal(again.get_parameter(n), p), n


def test_naming_fused_experts_is_an_error(moe):
    _, path = moe
    name = "model.layers.0.mlp.experts.gate_up_proj"
    recipe = FqnToConfig({name: Int4WeightOnlyConfig(group_size=32)})
    with pytest.raises(AOQError, match=rf"{name}: cannot quantize a 3-D .*fused MoE experts are 3-D"):
        AutoModelForCausalLM.from_pretrained(path, quantization_config=AOQConfig(recipe))


def test_a_named_router_is_quantized(moe, ids, tmp_path):
    name, path = moe
    router = "model.layers.0.mlp.gate"
    recipe = FqnToConfig({"_default": Int8WeightOnlyConfig(), router: Int8WeightOnlyConfig()})
    if name == "qwen2_moe":
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=AOQConfig(recipe))
        assert isinstance(model.get_parameter(f"{router}.weight"), Int8Tensor)
        expected = logits(model, ids)
        model.save_pretrained(tmp_path)
        assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(str(tmp_path)), ids), expected)
        return
    # Mixtral's checkpoint conversion mapping renames `mlp.` to `block_sparse_moe.` on save, so a
    # quantized router works in memory but cannot be saved under the name its metadata gives.
    with pytest.warns(UserWarning, match="save_pretrained will refuse it"):
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=AOQConfig(recipe))
    assert isinstance(model.get_parameter(f"{router}.weight"), Int8Tensor)
    logits(model, ids)
    with pytest.raises(AOQError, match=r"renames or converts \['model.layers.0.mlp.gate.weight'\]"):
        model.save_pretrained(tmp_path)
    assert list(tmp_path.iterdir()) == []  # refused before anything was written
