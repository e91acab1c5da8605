"""MoE models from transformers' own classes through the "aoq" quantizer: fused experts quantized.

transformers 5 keeps the routed experts of Mixtral, Qwen2/3-MoE and gpt-oss as fused 3-D
parameters (`experts.gate_up_proj`, `experts.down_proj`) on a custom module, and (Mixtral,
Qwen) converts per-expert checkpoint tensors into them while loading. hf_aoq quantizes them as
one 3-D tensor (each expert by the 2-D rule); the routers (2-D, not nn.Linear) stay float unless
named. A quantized model saves its experts fused, under the names transformers' save renamings
give (Mixtral's `mlp.` -> `block_sparse_moe.`), and loads back with the same logits.
"""
import json

import pytest
import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from conftest import sqnr
from hf_aoq import (
    AOQConfig,
    AOQTensor,
    Float8WeightOnlyConfig,
    FPxTensor,
    FPXWeightOnlyConfig,
    FqnToConfig,
    Int4DQWeightOnlyConfig,
    Int4Tensor,
    Int4WeightOnlyConfig,
    Int8Tensor,
    Int8WeightOnlyConfig,
)
from hf_aoq.tensors.experts import TransposedExperts

VOCAB = 256
COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB)
MODELS = {
    "mixtral": (MixtralForCausalLM, lambda: MixtralConfig(intermediate_size=128, num_local_experts=4,
                                                          num_experts_per_tok=2, **COMMON)),
    "qwen2_moe": (Qwen2MoeForCausalLM, lambda: Qwen2MoeConfig(
        intermediate_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=128, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], **COMMON)),
    "qwen3_moe": (Qwen3MoeForCausalLM, lambda: Qwen3MoeConfig(
        intermediate_size=128, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, head_dim=16,
        decoder_sparse_step=1, mlp_only_layers=[], **COMMON)),
    "gpt_oss": (GptOssForCausalLM, lambda: GptOssConfig(
        intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], **COMMON)),
}
ROUTER = {"mixtral": "mlp.gate", "qwen2_moe": "mlp.gate", "qwen3_moe": "mlp.gate", "gpt_oss": "mlp.router"}


@pytest.fixture(scope="module", params=sorted(MODELS))
def moe(request, tmp_path_factory):
    cls, config = MODELS[request.param]
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(request.param)
    model = cls(config())
    with torch.no_grad():  # gpt-oss initializes its router and expert biases to zero
        for n, p in model.named_parameters():
            if p.abs().max() == 0 and "norm" not in n:
                p.normal_(0, 0.02)
    model.save_pretrained(path)  # per-expert tensors on disk for Mixtral and Qwen, as on the Hub
    return request.param, str(path)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def unwrap(p):
    """gpt-oss's experts are the TransposedExperts view of the quantized [E, out, in] tensor."""
    return p.experts if isinstance(p, TransposedExperts) else p


def experts_of(model):
    return {n: unwrap(p) for n, p in model.named_parameters() if ".experts." in n and p.ndim == 3}


def test_experts_are_quantized_and_routers_stay_float(moe, ids):
    name, path = moe
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=AOQConfig(Int8WeightOnlyConfig()))
    experts = experts_of(model)
    assert len(experts) == 4  # gate_up_proj and down_proj of two layers
    for n, p in experts.items():
        assert type(p) is Int8Tensor and p.ndim == 3 and p.qdata.ndim == 3, n
    for layer in range(2):
        prefix = f"model.layers.{layer}"
        assert type(model.get_parameter(f"{prefix}.self_attn.q_proj.weight")) is Int8Tensor
        assert type(model.get_parameter(f"{prefix}.{ROUTER[name]}.weight")) is nn.Parameter
    ref = logits(AutoModelForCausalLM.from_pretrained(path), ids)
    assert sqnr(ref, logits(model, ids)) > 25


@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
def test_every_experts_implementation_runs_on_quantized_experts(moe, ids, implementation):
    _, path = moe
    cfg = AOQConfig(Int4WeightOnlyConfig(group_size=32))
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg, experts_implementation=implementation)
    assert all(type(p) is Int4Tensor for p in experts_of(model).values())
    out = logits(model, ids)
    # The same model with every quantized weight dequantized, run in float.
    model.dequantize()
    assert not any(isinstance(unwrap(p), AOQTensor) for p in model.parameters())
    want = logits(model, ids)
    assert sqnr(want, out) > 30, implementation


# (the _default config, down_proj's, and the types they give)
ROUND_TRIPS = {
    "int4+int8": (lambda: Int4WeightOnlyConfig(group_size=32), Int8WeightOnlyConfig, Int4Tensor, Int8Tensor),
    "fp6+fp5": (FPXWeightOnlyConfig, lambda: FPXWeightOnlyConfig(2, 2), FPxTensor, FPxTensor),
}


@pytest.mark.parametrize("recipe_name", sorted(ROUND_TRIPS))
def test_round_trip_through_shards_keeps_logits(moe, ids, tmp_path, recipe_name):
    name, path = moe
    default, down, default_type, down_type = ROUND_TRIPS[recipe_name]
    recipe = FqnToConfig({"_default": default(), "re:.*down_proj": down()})
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=AOQConfig(recipe))
    expected = logits(model, ids)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    # Experts stay fused on disk, under the saved names (Mixtral renames mlp. to block_sparse_moe.).
    mlp = "block_sparse_moe" if name == "mixtral" else "mlp"
    assert f"model.layers.0.{mlp}.experts.gate_up_proj:qdata" in index
    assert not any(".experts.0." in k for k in index)
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    kinds = {n: type(unwrap(p)) for n, p in again.named_parameters() if isinstance(unwrap(p), AOQTensor)}
    assert kinds == {n: type(unwrap(p)) for n, p in model.named_parameters() if isinstance(unwrap(p), AOQTensor)}
    assert kinds["model.layers.1.mlp.experts.down_proj"] is down_type
    assert kinds["model.layers.1.mlp.experts.gate_up_proj"] is default_type
    for n, p in experts_of(model).items():
        q = unwrap(again.get_parameter(n))
        assert getattr(q, "packing", None) == getattr(p, "packing", None), n  # placed for the kernels again
        assert q.attributes() == p.attributes(), n
        assert torch.equal(q.dequantize(), p.dequantize()), n
        for field, t in p.to_canonical().tensor_fields().items():  # bit for bit
            assert torch.equal(t.view(torch.uint8), q.to_canonical().tensor_fields()[field].view(torch.uint8)), n
    assert torch.equal(logits(again, ids), expected)


def test_recipes_target_and_skip_experts(moe):
    _, path = moe
    gate_up = "model.layers.0.mlp.experts.gate_up_proj"
    recipe = FqnToConfig({
        "_default": Int8WeightOnlyConfig(),
        gate_up: Int4DQWeightOnlyConfig(group_size=32),  # an exact name
        "re:model\\.layers\\.1\\.mlp\\.experts\\..*": None,  # a regex skips layer 1's experts
    })
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=AOQConfig(recipe))
    experts = experts_of(model)
    assert type(experts[gate_up]).__name__ == "Int4DQTensor"
    assert type(experts["model.layers.0.mlp.experts.down_proj"]) is Int8Tensor
    assert type(experts["model.layers.1.mlp.experts.down_proj"]) is nn.Parameter
    # modules_to_not_convert skips them too.
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=AOQConfig(Int8WeightOnlyConfig(), modules_to_not_convert=["experts"]))
    assert not any(isinstance(p, AOQTensor) for p in experts_of(model).values())


def test_a_named_router_is_quantized_saved_and_reloaded(moe, ids, tmp_path):
    # Mixtral's conversion mapping renames `mlp.` to `block_sparse_moe.` on save; a quantized
    # router used to be refused by save_pretrained ("renames or converts [...]").
    name, path = moe
    router = f"model.layers.0.{ROUTER[name]}"
    recipe = FqnToConfig({"_default": Float8WeightOnlyConfig(), f"{router}.weight": Int8WeightOnlyConfig()})
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=AOQConfig(recipe))
    assert isinstance(model.get_parameter(f"{router}.weight"), Int8Tensor)
    expected = logits(model, ids)
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert isinstance(again.get_parameter(f"{router}.weight"), Int8Tensor)
    assert torch.equal(logits(again, ids), expected)


def test_quantized_experts_shrink_the_checkpoint(moe, tmp_path):
    _, path = moe
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, quantization_config=AOQConfig(Int4WeightOnlyConfig(group_size=32)))
    float_experts = experts_of(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)).values()
    float_bytes = sum(p.nbytes for p in float_experts)
    quant_bytes = sum(sum(t.nbytes for t in p.to_canonical().tensor_fields().values()) for p in experts_of(model).values())
    # 16 bits -> 4 bits, and a bf16 scale and zero per group of 32: 5 bits per weight.
    assert quant_bytes == float_bytes * 5 // 16
