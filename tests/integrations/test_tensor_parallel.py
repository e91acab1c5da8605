"""Tensor parallelism: hf_aoq weights sharded by transformers' tp_plan over 2 CPU processes (gloo).

The distributed test launches tests/integrations/tp_worker.py with `torch.distributed.run
--nproc_per_node 2` once, for every case, and compares each rank's logits with the model loaded
in this (single) process. The other tests check the shard ops on one process.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_aoq
from hf_aoq.core.errors import AOQError
from hf_aoq.tensors import sharding
from models import tiny_llama_checkpoint

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from tp_worker import aoq_config  # noqa: E402

# TP sums the row-parallel layers' partial products across ranks (in bf16, as the model runs),
# so logits differ from one process by bf16 rounding: max |difference| / max |logit| measured
# 0.0058 for the bf16 model itself and at most 0.0070 for the quantized ones (fp8 per tensor).
RTOL = 0.02
# scripts/gpu_check.sh --tp2 sets nccl: 2 GPUs, and the one-process reference on a GPU too.
DEVICE = "cuda" if os.environ.get("HF_AOQ_TP_BACKEND") == "nccl" else "cpu"
QUANTS = ("int4", "int4dq", "int8", "fp8", "fp8_tensor")
IDS = [[1, 5, 9, 33, 100, 7, 2, 400, 17, 250]]


def _types():
    return {"int4": "Int4Tensor", "int4dq": "Int4DQTensor", "int8": "Int8Tensor",
            "fp8": "Float8Tensor", "fp8_tensor": "Float8Tensor"}


def _load(path, quant=None):
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": torch.bfloat16, "device_map": DEVICE}
    if quant is not None:
        kwargs["quantization_config"] = aoq_config(quant)
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def _logits(model):
    with torch.no_grad():
        return model(torch.tensor(IDS, device=model.device)).logits.float().cpu()


def _run_ranks(cases, tmp_path):
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps(cases))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(HERE.parents[1]), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "tp_worker.py"), str(spec)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return [[json.loads(Path(c["out"] + suffix).read_text()) for suffix in ("", ".rank1")] for c in cases]


def test_quantized_models_load_sharded_over_two_processes(tmp_path):
    float_dir = tmp_path / "bf16"
    tiny_llama_checkpoint(float_dir, tokenizer=False)
    cut_dir = tmp_path / "bf16_96"  # intermediate 96: down_proj's input splits 48 + 48
    tiny_llama_checkpoint(cut_dir, tokenizer=False, intermediate=96)
    reference = {None: _logits(_load(float_dir))}
    cases = [{"path": str(float_dir), "quant": None, "api": api, "name": f"bf16-{api}"}
             for api in ("tp_plan", "distributed_config")]
    for i, quant in enumerate(QUANTS):
        model = _load(float_dir, quant)
        reference[quant] = _logits(model)
        saved = tmp_path / quant
        model.save_pretrained(saved)
        # Each API with each path, alternating which path gets which.
        apis = ("tp_plan", "distributed_config") if i % 2 else ("distributed_config", "tp_plan")
        cases.append({"path": str(float_dir), "quant": quant, "api": apis[0], "name": f"{quant}-on-load"})
        cases.append({"path": str(saved), "quant": None, "api": apis[1], "name": f"{quant}-prequantized"})
    # The vocabulary-parallel embedding and the gathered lm_head quantized too; a sharded model
    # is not saved.
    reference["int4+embeddings"] = _logits(_load(float_dir, "int4+embeddings"))
    cases.append({"path": str(float_dir), "quant": "int4+embeddings", "api": "distributed_config",
                  "name": "int4+embeddings-on-load", "save": str(tmp_path / "not_saved")})
    text = tmp_path / "calibration.txt"
    text.write_text("w3 w4 w5 w6 " * 50)
    cases.append({"path": str(float_dir), "quant": "int4", "api": "tp_plan", "name": "calibration",
                  "calibration": str(text)})
    cases.append({"path": str(cut_dir), "quant": "int4", "api": "tp_plan", "name": "cuts-a-group"})
    for c in cases:
        c.update(out=str(tmp_path / f"{c['name']}.json"), input_ids=IDS)

    results = _run_ranks(cases, tmp_path)
    by_name = dict(zip([c["name"] for c in cases], results))

    for rank in by_name.pop("calibration"):
        assert not rank["ok"] and "calibration" in rank["error"] and "tp_plan" in rank["error"], rank
    cut = by_name.pop("cuts-a-group")
    for rank in cut:
        assert not rank["ok"] and rank["error"].startswith("AOQError"), rank  # refused before any weight is read
        assert "model.layers.0.mlp.down_proj.weight" in rank["error"] and "group size 32" in rank["error"], rank
    for case in cases[:-2]:
        quant = case["quant"] or (case["name"].split("-")[0] if "prequantized" in case["name"] else None)
        ref = reference[quant]
        for r, rank in enumerate(by_name[case["name"]]):
            assert rank["ok"], (case["name"], rank.get("traceback"))
            logits = torch.tensor(rank["logits"])
            err = float((logits - ref).abs().max() / ref.abs().max())
            print(f"{case['name']} rank {r}: max |logits - one process| / max |logits| = {err:.4f}")
            assert err <= RTOL, (case["name"], r, err)
            params = rank["params"]
            # Column-parallel: half the rows; row-parallel: half the columns; each rank its own.
            q, o = params["model.layers.0.self_attn.q_proj.weight"], params["model.layers.1.mlp.down_proj.weight"]
            assert (q["shape"], q["global"]) == ([64, 128], [128, 128]), (case["name"], q)
            assert (o["shape"], o["global"]) == ([128, 128], [128, 256]), (case["name"], o)
            want = _types()[quant.removesuffix("+embeddings")] if quant else "Tensor"
            assert q["type"] == o["type"] == want, (case["name"], q, o)
            assert rank["grad_logits_equal"], case["name"]
            if "embeddings" in case["name"]:
                for n in ("model.embed_tokens.weight", "lm_head.weight"):  # vocabulary split in two
                    assert (params[n]["type"], params[n]["shape"]) == ("Int4Tensor", [256, 128]), (n, params[n])
                assert "AOQError" in rank["save_error"] and "tensor-parallel shards" in rank["save_error"]
                assert not (tmp_path / "not_saved" / "model.safetensors").exists()
        r0, r1 = (torch.tensor(rank["logits"]) for rank in by_name[case["name"]])
        assert torch.equal(r0, r1), case["name"]  # both ranks end with the all-reduced logits


# ---------------------------------------------------------------------- one process
def _weights():
    torch.manual_seed(0)
    w = torch.randn(64, 128, dtype=torch.bfloat16)
    return {
        "int4": hf_aoq.Int4WeightOnlyConfig(group_size=32).quantize_weight(w),
        "int4dq": hf_aoq.Int4DQWeightOnlyConfig(group_size=32).quantize_weight(w),
        "int8": hf_aoq.Int8WeightOnlyConfig().quantize_weight(w),
        "int8_g32": hf_aoq.Int8WeightOnlyConfig(group_size=32).quantize_weight(w),
        "fp8": hf_aoq.Float8WeightOnlyConfig().quantize_weight(w),
        "fp8_tensor": hf_aoq.Float8WeightOnlyConfig(granularity=hf_aoq.PerTensor()).quantize_weight(w),
        "mx": hf_aoq.MXTensor.from_float(w),
        "fp8_sparse": hf_aoq.Float8SemiSparseTensor.from_float(w),
    }


@pytest.mark.parametrize("kind", list(_weights()))
@pytest.mark.parametrize("dim", [0, 1])
def test_a_shard_is_a_quantized_weight_of_the_shard(kind, dim):
    t = _weights()[kind]
    full = t.dequantize()
    halves = torch.chunk(t, 2, dim=dim)  # aten.split
    assert [type(h) for h in halves] == [type(t)] * 2
    for h, ref in zip(halves, torch.chunk(full, 2, dim=dim)):
        type(h).check_fields(h.fields())  # a loader would accept it as it is
        assert torch.equal(h.dequantize(), ref)
    assert torch.equal(torch.narrow(t, dim, 32, 32).dequantize(), full.narrow(dim, 32, 32))
    again = torch.cat(list(halves), dim=dim)
    assert type(again) is type(t) and again.shape == t.shape
    assert torch.equal(again.dequantize(), full)
    assert {n: v.shape for n, v in again.tensor_fields().items()} == {n: v.shape for n, v in t.tensor_fields().items()}
    # What DTensor.from_local / to_local do: a view as itself.
    assert torch.equal(t.view_as(t).dequantize(), full) and torch.equal(t.view(-1, 128).dequantize(), full)


def test_a_cut_inside_a_group_is_refused_with_the_parameter_and_group_size():
    t = _weights()["int4"]
    with pytest.raises(AOQError, match=r"layers\.0\.mlp\.down_proj\.weight.*group size 32"):
        sharding.check_cut(t, 1, 48, 96, "layers.0.mlp.down_proj.weight")
    sharding.check_cut(t, 1, 64, 128, "w")  # whole groups
    sharding.check_cut(_weights()["int8"], 1, 48, 96, "w")  # a per-row scale is kept by every shard
    with pytest.raises(AOQError, match="align"):
        t[:, 16:48]


def test_views_and_cats_that_would_lose_the_layout_are_refused():
    t = _weights()["int8"]
    with pytest.raises(AOQError, match="cannot be viewed"):
        t.view(128, 64)
    with pytest.raises(AOQError, match="differ elsewhere"):
        torch.cat([t, _weights()["int8_g32"]], dim=0)
    with pytest.raises(AOQError, match="differs between the parts"):  # two per-tensor scales
        a, b = _weights()["fp8_tensor"], hf_aoq.Float8WeightOnlyConfig(granularity=hf_aoq.PerTensor()).quantize_weight(
            torch.randn(64, 128, dtype=torch.bfloat16) * 3)
        torch.cat([a, b], dim=1)


def test_gpu_check_runs_this_test_on_two_gpus_with_tp2(tmp_path):
    root = HERE.parents[1]
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable)
    done = subprocess.run(["bash", str(root / "scripts" / "gpu_check.sh"), "--dry-run", "--tp2"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    step = [line for line in done.stdout.splitlines() if "test_tensor_parallel.py" in line]
    assert len(step) == 1 and step[0].startswith("+ timeout") and "HF_AOQ_TP_BACKEND=nccl" in step[0], step
    plain = subprocess.run(["bash", str(root / "scripts" / "gpu_check.sh"), "--dry-run"], env=env,
                           capture_output=True, text=True, timeout=60)
    assert "test_tensor_parallel.py" not in plain.stdout  # behind the flag only


class _Mesh:
    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def get_local_rank(self, mesh_dim):
        return self.rank

    def size(self, mesh_dim):
        return self.world


class _Placeholder:
    """What local_shard reads of transformers' DTensor placeholder."""

    def __init__(self, shape, placement, rank, world=2):
        self.shape, self.ndim = torch.Size(shape), len(shape)
        self.placements, self.device_mesh = (placement,), _Mesh(rank, world)


@pytest.mark.parametrize("kind", ["int4", "int4dq", "int8", "fp8_tensor"])
def test_local_shard_cuts_contiguous_and_strided_placements(kind):
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    from hf_aoq.integrations.transformers.tensor_parallel import local_shard

    t = _weights()[kind]
    full = t.dequantize()
    for rank in (0, 1):
        cols = local_shard(t, _Placeholder(t.shape, Shard(1), rank), "w")
        assert torch.equal(cols.dequantize(), full[:, 64 * rank:64 * (rank + 1)])
        # packed_colwise (a fused gate_up): this rank's quarter of each half, concatenated.
        fused = local_shard(t, _Placeholder(t.shape, _StridedShard(0, split_factor=2), rank), "w")
        want = torch.cat([full[16 * rank:16 * (rank + 1)], full[32 + 16 * rank:32 + 16 * (rank + 1)]])
        assert type(fused) is type(t) and torch.equal(fused.dequantize(), want)
        type(fused).check_fields(fused.fields())
    if kind in ("int4", "int4dq"):
        with pytest.raises(AOQError, match=r"w: .*\[0:43\] of dim 1.*group size 32"):
            local_shard(t, _Placeholder(t.shape, Shard(1), 0, world=3), "w")  # 128 = 43 + 43 + 42
