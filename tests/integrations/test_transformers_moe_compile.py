"""torch.compile of a transformers MoE forward on quantized fused experts.

transformers' "grouped_mm" experts forward (the default) compiles with fullgraph=True on a bf16
model; with hf_aoq experts it does too: a compiled grouped_mm is one opaque op that runs the
eager expert loop (tensors/experts.py), so each expert runs on its own rows, as in eager mode.
("batched_mm" compiles with fullgraph too, and "eager", whose loop over the experts that got
tokens transformers itself cannot trace whole, with graph breaks; both were checked by hand, not
here: each compile takes tens of seconds on a CPU, so this tests one tiny one-layer model.)
"""
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

import pytest

from hf_aoq import AOQConfig, FPxTensor, FPXWeightOnlyConfig, Int4Tensor, Int4WeightOnlyConfig
from hf_aoq.tensors import experts

COMMON = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
              intermediate_size=128, num_local_experts=4, num_experts_per_tok=2)


CONFIGS = {"int4": (lambda: Int4WeightOnlyConfig(group_size=32), Int4Tensor), "fp6": (FPXWeightOnlyConfig, FPxTensor)}


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_compiled_moe_forward_on_quantized_experts_matches_eager(tmp_path, monkeypatch, kind):
    config, tensor_type = CONFIGS[kind]
    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(**COMMON)).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.bfloat16, experts_implementation="grouped_mm",
        quantization_config=AOQConfig(config()))
    assert type(model.get_parameter("model.layers.0.mlp.experts.gate_up_proj")) is tensor_type
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    rows = []  # the rows each expert's product gets, in call order
    times = experts._times
    monkeypatch.setattr(experts, "_times", lambda x, w, transposed: rows.append(x.shape[0]) or times(x, w, transposed))
    with torch.no_grad():
        eager = model(ids).logits.float()
        eager_rows, rows[:] = list(rows), []
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)(ids).logits.float()
    # Each expert that got tokens runs once on its own rows (gate_up, then down), as in eager
    # mode; before, every expert ran on all 24 routed rows.
    assert sum(eager_rows) == 2 * 12 * 2 and rows == eager_rows, (rows, eager_rows)
    # The compiled graph fuses the float ops around the experts differently: bf16 rounding.
    err = float((compiled - eager).abs().max() / eager.abs().max())
    assert err <= 0.02, err
