"""Quantized fused MoE experts [E, N, K] under transformers' tensor and expert parallelism.

transformers 5.24's MoE plans (Mixtral, Qwen3-MoE) cut the experts for TP: `gate_up_proj`
"packed_colwise" (each rank this rank's part of the gate half and of the up half, a strided
shard of dim 1) and `down_proj` "rowwise" (dim 2, K); 5.25's leave them whole and cut the
attention only, as gpt-oss's always left its experts. The expected shapes follow the installed
transformers' plan (`_tp_cuts`). With `DistributedConfig(tp_plan="auto", ep_size=2)` their EP plans ("grouped_gemm")
give each rank whole experts (a shard of dim 0), and the "ep_dispatch_experts" module runs them.
hf_aoq cuts the quantized experts the same way (tensor_parallel.local_shard), codes and scales
together. The distributed test launches tests/integrations/tp_worker.py once over 2 CPU
processes (gloo) for every case; the other tests cut on one process.
"""
import pytest
import torch
from torch.distributed.tensor.placement_types import Shard, _StridedShard

import hf_aoq
from hf_aoq.core.errors import AOQError
from hf_aoq.integrations.transformers.tensor_parallel import check_plan, local_shard, probe_layout
from test_tensor_parallel import DEVICE, RTOL, _Placeholder, _run_ranks
from test_transformers_moe import MODELS
from tp_worker import aoq_config

# MX quantizes activations too (32-element blocks, float8): the bf16 rounding differences of the
# all-reduced sums move some of them to the next code, so logits differ more (measured at most
# 0.014 on Mixtral, against 0.007 for the other types).
RTOL_MX = 0.04
EP = {"tp_plan": "auto", "ep_size": 2}
IDS = [[1, 5, 9, 33, 100, 7, 2, 200, 17, 250]]
TYPES = {"int4": "Int4Tensor", "int4dq": "Int4DQTensor", "int8": "Int8Tensor", "fp8": "Float8Tensor",
         "mx": "MXTensor", "fp6": "FPxTensor"}
# (model, quant, experts_implementation): int4 and int8 on Mixtral and Qwen3-MoE from both sources
# under both plans; the others each source under one plan, alternating.
RUNS = [(m, q, None) for m in ("mixtral", "qwen3_moe") for q in ("int4", "int8")]
RUNS += [("mixtral", q, None) for q in ("int4dq", "fp8", "mx")]
RUNS += [("gpt_oss", "int4", None), ("mixtral", "int4", "eager"), ("mixtral", "int8", "batched_mm")]
RUNS += [("mixtral", "fp6", None)]  # last, so the runs above keep their plans
FULL = 4  # the first FULL runs: every source under every plan


def _checkpoint(name, path, **overrides):
    cls, make_config = MODELS[name]
    config = make_config()
    for k, v in overrides.items():
        setattr(config, k, v)
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():  # gpt-oss initializes its router and expert biases to zero
        for n, p in model.named_parameters():
            if p.abs().max() == 0 and "norm" not in n:
                p.normal_(0, 0.02)
    model.save_pretrained(path)
    return str(path)


def _single_process(path, quant, implementation):
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": torch.bfloat16, "device_map": DEVICE, "quantization_config": aoq_config(quant)}
    if implementation:
        kwargs["experts_implementation"] = implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    with torch.no_grad():
        return model, model(torch.tensor(IDS, device=model.device)).logits.float().cpu()


def _tp_cuts(name, module):
    """Whether the installed transformers' TP plan for `name` cuts the parameters ending in
    `module` (5.24 cut Mixtral's and Qwen3-MoE's experts, 5.25 leaves them whole)."""
    return any(key.endswith(module) for key in MODELS[name][1]().base_model_tp_plan or {})


def _expected_shapes(name, api):
    """Layer 0's (gate_up_proj, down_proj) on one rank, as transformers' plans cut them."""
    if name == "gpt_oss":  # [E, in, out]; TP leaves the experts whole
        whole = ([4, 64, 128], [4, 64, 64])
        return ([2, 64, 128], [2, 64, 64]) if api == "ep" else whole
    inter = 128 if name == "mixtral" else 64
    if api == "ep":  # two whole experts of four
        return [2, 2 * inter, 64], [2, 64, inter]
    if not _tp_cuts(name, "experts.down_proj"):  # a TP plan that leaves the experts whole
        return [4, 2 * inter, 64], [4, 64, inter]
    return [4, inter, 64], [4, 64, inter // 2]  # half of each of gate and up; half of K


def test_quantized_experts_load_under_tp_and_ep_over_two_processes(tmp_path):
    paths = {name: _checkpoint(name, tmp_path / name) for name in sorted({r[0] for r in RUNS})}
    cases, reference = [], {}
    for i, (name, quant, impl) in enumerate(RUNS):
        run = f"{name}-{quant}-{impl or 'default'}"
        model, reference[run] = _single_process(paths[name], quant, impl)
        saved = tmp_path / f"{run}-saved"
        model.save_pretrained(saved)
        plans = [("tp", "on-load"), ("ep", "prequantized"), ("ep", "on-load"), ("tp", "prequantized")]
        if i >= FULL:  # one of each source, the plans alternating
            plans = plans[:2] if i % 2 else plans[2:]
        for j, (api, source) in enumerate(plans):
            cases.append({"path": paths[name] if source == "on-load" else str(saved),
                          "quant": quant if source == "on-load" else None, "run": run,
                          "api": "ep" if api == "ep" else ("tp_plan", "distributed_config")[(i + j) % 2],
                          "distributed": EP if api == "ep" else None, "experts_implementation": impl,
                          "name": f"{run}-{api}-{source}", "model": name, "quant_name": quant})
    # A "rowwise" cut of K = 96 into 48 + 48 falls inside a group of 32: the experts' down_proj
    # where the plan cuts the experts, else o_proj (6 heads of 16).
    if _tp_cuts("mixtral", "experts.down_proj"):
        cut = _checkpoint("mixtral", tmp_path / "mixtral_96", intermediate_size=96)
        cut_name = "model.layers.0.mlp.experts.down_proj"
    else:
        cut = _checkpoint("mixtral", tmp_path / "mixtral_96", num_attention_heads=6, head_dim=16)
        cut_name = "model.layers.0.self_attn.o_proj"
    cases.append({"path": cut, "quant": "int4", "api": "tp_plan", "name": "cuts-a-group"})
    for c in cases:
        c.update(out=str(tmp_path / f"{c['name']}.json"), input_ids=IDS)

    results = dict(zip([c["name"] for c in cases], _run_ranks(cases, tmp_path)))

    for rank in results.pop("cuts-a-group"):
        assert not rank["ok"] and rank["error"].startswith("AOQError"), rank  # refused before any weight is read
        assert cut_name in rank["error"] and "group size 32" in rank["error"], rank
    for case in cases[:-1]:
        ref = reference[case["run"]]
        api = "ep" if case["api"] == "ep" else "tp"
        tol = RTOL_MX if case["quant_name"] == "mx" else RTOL
        for r, rank in enumerate(results[case["name"]]):
            assert rank["ok"], (case["name"], rank.get("traceback"))
            logits = torch.tensor(rank["logits"])
            err = float((logits - ref).abs().max() / ref.abs().max())
            print(f"{case['name']} rank {r}: max |logits - one process| / max |logits| = {err:.4f}")
            assert err <= tol, (case["name"], r, err)
            assert rank["grad_logits_rel_diff"] <= tol, (case["name"], rank["grad_logits_rel_diff"])
            params = rank["params"]
            prefix = "model.layers.0.mlp.experts."
            got = tuple(params[prefix + p]["shape"] for p in ("gate_up_proj", "down_proj"))
            assert got == tuple(_expected_shapes(case["model"], api)), (case["name"], got)
            want = TYPES[case["quant_name"]]
            assert params[prefix + "gate_up_proj"]["type"] == params[prefix + "down_proj"]["type"] == want
        r0, r1 = (torch.tensor(rank["logits"]) for rank in results[case["name"]])
        assert torch.equal(r0, r1), case["name"]  # both ranks end with the all-reduced logits


# ---------------------------------------------------------------------- one process
E, N, K = 4, 64, 128
CONFIGS = {
    "int4": hf_aoq.Int4WeightOnlyConfig(group_size=32),
    "int4dq": hf_aoq.Int4DQWeightOnlyConfig(group_size=32),
    "int8": hf_aoq.Int8WeightOnlyConfig(),
    "int8_g32": hf_aoq.Int8WeightOnlyConfig(group_size=32),
    "fp8": hf_aoq.Float8WeightOnlyConfig(),
    "fp8_tensor": hf_aoq.Float8WeightOnlyConfig(granularity=hf_aoq.PerTensor()),
    "mxfp8": hf_aoq.MXFPInferenceConfig(),
    "mxfp4": hf_aoq.MXFPInferenceConfig(weight_dtype=torch.float4_e2m1fn_x2),
    "fp6": hf_aoq.FPXWeightOnlyConfig(),  # rowwise: 64 codes of 6 bits, 48 whole bytes per rank
}


def _experts(kind):
    w = torch.randn(E, N, K, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    return CONFIGS[kind].quantize_weight(w * torch.linspace(0.5, 4, E)[:, None, None].to(torch.bfloat16))


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_each_plan_cuts_the_experts_into_quantized_experts_of_the_shard(kind):
    t = _experts(kind)
    full = t.dequantize()
    for rank in (0, 1):
        wants = {
            "grouped_gemm (EP)": (Shard(0), full[2 * rank:2 * rank + 2]),
            "rowwise": (Shard(2), full[:, :, 64 * rank:64 * (rank + 1)]),
            "packed_colwise": (_StridedShard(1, split_factor=2),
                               torch.cat([full[:, 16 * rank:16 * (rank + 1)], full[:, 32 + 16 * rank:48 + 16 * rank]], 1)),
        }
        for plan, (placement, want) in wants.items():
            shard = local_shard(t, _Placeholder(t.shape, placement, rank), "w")
            assert type(shard) is type(t) and shard.ndim == 3, plan
            type(shard).check_fields(shard.fields())  # a loader would accept it as it is
            assert torch.equal(shard.dequantize(), want), (kind, plan, rank)


@pytest.mark.parametrize("kind", ["int4", "int4dq", "mxfp4"])
def test_a_cut_through_a_group_of_the_experts_is_refused_before_loading(kind):
    # What a quantize-on-load plan checks before any weight is read: the probe for 3-D experts
    # has their layout along K, so Shard(2) over 3 ranks (128 = 43 + 43 + 42) cuts a group.
    name = "model.layers.0.mlp.experts.down_proj"
    probe = probe_layout(CONFIGS[kind], (E, N, K), torch.bfloat16, name)
    assert probe.ndim == 3
    with pytest.raises(AOQError, match=r"experts\.down_proj: .*\[0:43\] of dim 2.*group size 32"):
        check_plan(probe, _Placeholder((E, N, K), Shard(2), 0, world=3), name)
    check_plan(probe, _Placeholder((E, N, K), Shard(2), 1, world=2), name)  # whole groups
    check_plan(probe, _Placeholder((E, N, K), Shard(0), 1, world=4), name)  # one expert each
    with pytest.raises(AOQError, match="group size 32"):  # and the weight itself, when it is built
        local_shard(_experts(kind), _Placeholder((E, N, K), Shard(2), 0, world=3), name)

