"""One rank of a tensor-parallel load, launched by tests/integrations/test_tensor_parallel.py
(or by hand: `python -m torch.distributed.run --nproc_per_node 2 tests/integrations/tp_worker.py
CASES.json`). For each case it loads a checkpoint with transformers' `tp_plan="auto"` (or
`distributed_config=DistributedConfig(tp_plan="auto")`), runs one forward pass and records the
logits and every parameter's local (this rank's) shape and type; rank 0's record goes to the
case's "out" path, the other ranks' to "<out>.rank<r>". A case that raises records the error.

HF_AOQ_TP_BACKEND=nccl runs it on one GPU per rank over NCCL (scripts/gpu_check.sh --tp2);
the default is gloo on CPU.

CASES.json: [{"path": ..., "out": ..., "api": "tp_plan" | "distributed_config" | "ep",
              "quant": null or a name in RECIPES, "input_ids": [[...]]}, ...]
"ep" takes the DistributedConfig's arguments from the case's "distributed" (e.g. {"tp_plan":
"auto", "ep_size": 2}); "experts_implementation", if given, goes to from_pretrained.
"""
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist


RECIPES = {
    "int4": lambda h: h.Int4WeightOnlyConfig(group_size=32),
    "int4dq": lambda h: h.Int4DQWeightOnlyConfig(group_size=32),
    "int8": lambda h: h.Int8WeightOnlyConfig(),
    "fp8": lambda h: h.Float8WeightOnlyConfig(),
    "fp8_tensor": lambda h: h.Float8WeightOnlyConfig(granularity=h.PerTensor()),
    "mx": lambda h: h.MXFPInferenceConfig(),
    "fp6": lambda h: h.FPXWeightOnlyConfig(),
}
EMBEDDINGS = "+embeddings"  # a suffix: also quantize the input embedding and lm_head


def aoq_config(quant):
    """The AOQConfig a case names (None: no quantization_config)."""
    import hf_aoq

    if quant is None:
        return None
    base = quant.removesuffix(EMBEDDINGS)
    return hf_aoq.AOQConfig(RECIPES[base](hf_aoq), include_input_output_embeddings=base != quant)


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def run_case(case, rank):
    import hf_aoq  # noqa: F401  (registers "aoq")
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    kwargs = {"dtype": torch.bfloat16}
    quant = aoq_config(case.get("quant"))
    if case.get("calibration"):
        quant.calibration = case["calibration"]
    if quant is not None:
        kwargs["quantization_config"] = quant
    if case.get("experts_implementation"):
        kwargs["experts_implementation"] = case["experts_implementation"]
    if case["api"] == "tp_plan":
        kwargs["tp_plan"] = "auto"
    elif case["api"] == "distributed_config":
        kwargs["distributed_config"] = DistributedConfig(tp_plan="auto")
    else:  # "ep": the experts split between the ranks, whole (and the rest as `distributed`'s tp_plan says)
        kwargs["distributed_config"] = DistributedConfig(**case["distributed"])
    model = AutoModelForCausalLM.from_pretrained(case["path"], **kwargs)
    ids = torch.tensor(case["input_ids"], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits
    with_grad = model(ids).logits  # autograd on: transformers' DTensor path for what is not local
    params = {}
    for name, p in model.named_parameters():
        local = _local(p.data if isinstance(p, torch.nn.Parameter) else p)
        stored = getattr(local, "experts", local)  # gpt-oss's experts: the TransposedExperts view of it
        params[name] = {"type": type(stored).__name__, "shape": list(local.shape),
                        "global": list(p.shape)}
    record = {"ok": True, "logits": logits.float().tolist(), "params": params,
              "grad_logits_equal": bool(torch.equal(with_grad.detach(), logits)),
              # Under expert parallelism transformers exchanges tokens all-to-all when autograd is on
              # (and all-reduces partial outputs when it is off): equal up to the order of the sums.
              "grad_logits_rel_diff": float((with_grad.detach() - logits).abs().max() / logits.abs().max())}
    if case.get("save"):
        try:
            model.save_pretrained(case["save"])
        except Exception as e:
            record["save_error"] = f"{type(e).__name__}: {e}"
    return record


def main():
    cases = json.load(open(sys.argv[1]))
    backend = os.environ.get("HF_AOQ_TP_BACKEND", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    rank = dist.get_rank()
    for case in cases:
        try:
            record = run_case(case, rank)
        except Exception as e:  # recorded for the test to assert on
            record = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        out = case["out"] if rank == 0 else f"{case['out']}.rank{rank}"
        with open(out, "w") as f:
            json.dump(record, f)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
