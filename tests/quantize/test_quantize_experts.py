"""The planner and fused MoE experts on a plain nn.Module: which 3-D parameters a recipe reaches."""
import torch
from torch import nn

from hf_aoq import AOQTensor, FqnToConfig, Int4Tensor, Int8Tensor, Int8WeightOnlyConfig, Int4WeightOnlyConfig, quantize_
from hf_aoq.quantize import plan


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Module()
        self.router.weight = nn.Parameter(torch.randn(4, 64))  # 2-D, not nn.Linear: stays float
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.randn(4, 128, 64))
        self.experts.down_proj = nn.Parameter(torch.randn(4, 64, 64))
        self.experts.down_proj_bias = nn.Parameter(torch.randn(4, 64))  # 2-D bias: stays float
        self.conv = nn.Conv1d(64, 64, 3)  # a 3-D kernel that is not experts
        self.proj = nn.Linear(64, 64)


def kinds(m):
    return {n: type(p).__name__ for n, p in m.named_parameters()}


def test_a_single_config_takes_fused_experts_and_leaves_routers_biases_and_convolutions():
    m = quantize_(Block(), Int8WeightOnlyConfig())
    assert kinds(m) == {
        "router.weight": "Parameter", "experts.gate_up_proj": "Int8Tensor", "experts.down_proj": "Int8Tensor",
        "experts.down_proj_bias": "Parameter", "conv.weight": "Parameter", "conv.bias": "Parameter",
        "proj.weight": "Int8Tensor", "proj.bias": "Parameter",
    }
    assert m.experts.gate_up_proj.shape == (4, 128, 64) and m.experts.gate_up_proj.packing is not None  # placed


def test_fqn_to_config_default_regex_and_exact_names_reach_experts():
    recipe = FqnToConfig({"_default": Int8WeightOnlyConfig(), "re:experts\\.down.*": None,
                          "experts.gate_up_proj": Int4WeightOnlyConfig(group_size=32)})
    m = quantize_(Block(), recipe)
    assert isinstance(m.experts.gate_up_proj, Int4Tensor)
    assert not isinstance(m.experts.down_proj, AOQTensor)
    assert isinstance(m.proj.weight, Int8Tensor) and not isinstance(m.router.weight, AOQTensor)
    assert not isinstance(m.conv.weight, AOQTensor)
    # Without _default, a regex alone selects experts.
    decisions = plan(Block(), FqnToConfig({"re:.*_proj": Int8WeightOnlyConfig()}))
    assert sorted(decisions) == ["experts.down_proj", "experts.gate_up_proj"]


def test_a_filter_fn_restricts_experts_too():
    m = quantize_(Block(), Int8WeightOnlyConfig(), filter_fn=lambda module, name: isinstance(module, nn.Linear))
    assert not isinstance(m.experts.gate_up_proj, AOQTensor) and isinstance(m.proj.weight, Int8Tensor)
